"""The plot (``--plot``, matplotlib): one panel per question, each target
drawn only over the rows it applies to. ``panels`` says what is drawn (data,
testable without matplotlib); ``plot`` draws it."""
from __future__ import annotations

import math
import os
import platform

from ferrox_kv.bench.common import GEOMETRIES
from ferrox_kv.bench.harness import TIME_IN, fmt_num

_HF = [("hf.ferrox.vs_dynamic", "FerroxCache pooled, ferrox attention (in place)", "C0"),
       ("hf.dynamic", "DynamicCache + SDPA (transformers default)", "C1"),
       ("hf.static.vs_dynamic", "StaticCache + SDPA", "C2")]
_ATTN = [("attention.attend.vs_floor", "ferrox attend, pooled, in place", "C0"),
         ("attention.sdpa", "SDPA over contiguous tensors (what DynamicCache hands it)", "C1"),
         ("attention.gather_sdpa", "gather .k/.v + SDPA", "C3"),
         ("attention.floor", "read floor (K+V read once, C)", "0.5")]

# (panel title, y label, [(slug, bar label, row field plotted)]); a field of
# "ratio" plots the row's own ratio, the one its targets are set on
_BARS = [
    ("(b) push: time per position against the floor's (C memcpy, fresh memory)",
     "time / floor's time (1 = hardware limit; lower is better)",
     [("push.with_capacity.vs_floor", "push, with_capacity", "ratio"),
      ("push.pooled.vs_unpooled", "push, with_pool (pool in use)", "vs_floor")]),
    ("(c) extend(512): bandwidth against the floor's (C memcpy, fresh memory)",
     "bandwidth / floor's bandwidth (1 = hardware limit; higher is better)",
     [("extend.with_capacity.vs_floor", "extend(512), with_capacity", "ratio"),
      ("extend.pooled.vs_floor", "extend(512), with_pool", "ratio")]),
]


def _decode_panel(res):
    for group, choice, title in [
            ("hf", _HF, "(a) decode step of a 2-layer Llama (32 q / 8 KV heads x 128), "
             "1 torch thread"),
            ("attention", _ATTN, "(a) one layer's decode attention (32 q / 8 KV heads x 128),"
             " 1 thread")]:
        series = []
        for slug, label, color in choice:
            pts = sorted((r["context"], r["value"] * TIME_IN[r["unit"].split("/")[0]] * 1e3)
                         for r in res.rows if r["slug"] == slug and r.get("threads", 1) == 1)
            if pts:
                series.append({"label": label, "color": color, "points": pts})
        if series:
            return {"kind": "lines", "title": title, "series": series, "targets": [],
                    "ylabel": "time per token (ms, log scale; lower is better)",
                    "xlabel": "context (positions already in the cache, log scale)"}
    return {"kind": "empty", "title": "(a) per-token decode cost against context",
            "text": "no per-token figures in this run\n(run the hf or attention group)"}


def _precision_panel(res):
    """(d), when the precision group ran: per storage dtype, its bytes per
    position and its decode attend time at the longest context, each against
    float32's."""
    by = {r["dtype"]: r["ratio"] for r in res.rows if r["slug"].startswith("precision.bytes.")}
    if not by:
        return None
    att = [r for r in res.rows if r["slug"].startswith("precision.attend.") and r.get("threads", 1) == 1]
    ctx = max((r["context"] for r in att), default=None)
    series = [("bytes per position (K+V, scales included)", by)]
    if ctx is not None:
        series.append((f"decode attend time @ {ctx}",
                       {r["dtype"]: r["ratio"] for r in att if r["context"] == ctx}))
    return {"kind": "dtypes", "title": "(d) storage dtypes against float32 (llama8b, pooled)",
            "ylabel": "ratio to float32 (1 = float32; lower is better)",
            "dtypes": list(by), "series": series}


_SCALING = [("attention.attend.vs_floor", "ferrox attend, pooled, in place"),
            ("attention.sdpa", "SDPA over contiguous tensors"),
            ("attention.floor", "read floor (K+V read once, C)")]


def _threads_panel(res):
    """(e), when the attention group ran at more than one thread count:
    decode attention time at the longest context against its own 1-thread
    time, for ferrox, SDPA and the read floor."""
    rows = [r for r in res.rows if r["slug"] == "attention.attend.vs_floor"]
    counts = sorted({r.get("threads", 1) for r in rows})
    if len(counts) < 2:
        return None
    ctx = max(r["context"] for r in rows)
    series = []
    for slug, label in _SCALING:
        one = res.find(slug, context=ctx, threads=1)
        if one is None:
            continue
        vals = {}
        for n in counts:
            r = res.find(slug, context=ctx, threads=n)
            if r is not None:
                vals[f"{n} thread{'s' if n > 1 else ''}"] = r["value"] / one["value"]
        series.append((label, vals))
    return {"kind": "dtypes", "title": f"(e) decode attention @ {ctx} against threads (32 q / 8 KV x 128)",
            "ylabel": "time / its own 1-thread time (lower is better)",
            "dtypes": [f"{n} thread{'s' if n > 1 else ''}" for n in counts], "series": series}


def panels(res, evaluated=()):
    """What the plot draws, one dict per panel: (a) per-token cost against
    context; (b) push time against its floor; (c) extend bandwidth against
    its floor; (d), when the precision group ran, bytes and attend time per
    storage dtype; (e), when attention ran at several thread counts, its
    scaling against torch's and the read floor's. A bar panel's ``targets`` are (geometry, op, goal) for the
    targets whose ratio is the one plotted, at the geometry they name."""
    out = [_decode_panel(res)]
    for title, ylabel, spec in _BARS:
        bars = []
        for geo in GEOMETRIES:
            for slug, label, fld in spec:
                r = res.find(slug, geometry=geo)
                if r is not None and r.get(fld) is not None:
                    bars.append((geo, label, r[fld]))
        if not bars:
            out.append({"kind": "empty", "title": title,
                        "text": "no figures for this panel in this run"})
            continue
        plotted = {slug for slug, _, fld in spec if fld == "ratio"}
        geos = [g for g in GEOMETRIES if any(b[0] == g for b in bars)]
        marks = [(v.target.where.get("geometry"), v.target.op, v.target.goal)
                 for v in evaluated
                 if v.target.slug in plotted and v.target.goal is not None
                 and v.target.where.get("geometry") in geos]
        out.append({"kind": "bars", "title": title, "ylabel": ylabel, "geos": geos,
                    "bars": bars, "targets": marks})
    for extra in (_precision_panel(res), _threads_panel(res)):
        if extra is not None:
            out.append(extra)
    return out


def _draw_lines(ax, p):
    from matplotlib.ticker import NullFormatter
    ys_all, xs_all = [], set()
    for s in p["series"]:
        xs = [x for x, _ in s["points"]]
        ys = [y for _, y in s["points"]]
        ax.plot(xs, ys, "o-", color=s["color"], label=s["label"])
        ys_all += ys
        xs_all.update(xs)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(sorted(xs_all))
    ax.set_xticklabels([str(x) for x in sorted(xs_all)])
    ax.xaxis.set_minor_formatter(NullFormatter())
    lo, hi = min(ys_all), max(ys_all)
    ticks = [m * 10.0 ** e for e in range(math.floor(math.log10(lo)) - 1,
                                          math.ceil(math.log10(hi)) + 1) for m in (1, 2, 5)]
    ticks = [t for t in ticks if lo / 1.3 <= t <= hi * 1.3] or [lo, hi]
    ax.set_ylim(min(lo, ticks[0]) / 1.15, max(hi, ticks[-1]) * 1.15)
    ax.set_yticks(ticks)
    ax.set_yticklabels([fmt_num(t) for t in ticks])
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(p["xlabel"])
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)


def _draw_bars(ax, p):
    geos, bars = p["geos"], p["bars"]
    labels = list(dict.fromkeys(b[1] for b in bars))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        xs, ys = [], []
        for i, geo in enumerate(geos):
            for b in bars:
                if b[0] == geo and b[1] == label:
                    xs.append(i + (j - (len(labels) - 1) / 2) * width)
                    ys.append(b[2])
        ax.bar(xs, ys, width, label=label, color=f"C{j}")
    ax.axhline(1.0, color="k", lw=1, ls="--")
    for geo, op, goal in p["targets"]:
        i = geos.index(geo)
        ax.hlines(goal, i - 0.45, i + 0.45, color="C3", lw=2, ls=":",
                  label=f"target, {geo} only: {op} {goal:g}")
    top = max([b[2] for b in bars] + [g for _, _, g in p["targets"]] + [1.0])
    ax.set_ylim(0, top * 1.6)
    ax.set_xticks(range(len(geos)))
    ax.set_xticklabels([f"{g}\n{GEOMETRIES[g][0]}x{GEOMETRIES[g][1]}" for g in geos])
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)


def _draw_dtypes(ax, p):
    dtypes, series = p["dtypes"], p["series"]
    width = 0.8 / len(series)
    for j, (label, values) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i, dt in enumerate(dtypes) if dt in values]
        ax.bar(xs, [values[dt] for dt in dtypes if dt in values], width, label=label, color=f"C{j}")
    ax.axhline(1.0, color="k", lw=1, ls="--")
    top = max([v for _, values in series for v in values.values()] + [1.0])
    ax.set_ylim(0, top * 1.4)
    ax.set_xticks(range(len(dtypes)))
    ax.set_xticklabels(dtypes)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)


_DRAW = {"lines": _draw_lines, "bars": _draw_bars, "dtypes": _draw_dtypes}


def plot(res, path, evaluated=(), version=""):
    """Draw ``panels(res, evaluated)`` side by side into ``path`` (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = panels(res, evaluated)
    fig, axes = plt.subplots(1, len(ps), figsize=(6.2 * len(ps), 5.2))
    for ax, p in zip(axes, ps):
        if p["kind"] == "empty":
            ax.text(0.5, 0.5, p["text"], ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
        else:
            _DRAW[p["kind"]](ax, p)
            ax.set_ylabel(p["ylabel"])
        ax.set_title(p["title"], fontsize=9)
    fig.suptitle(f"ferrox_kv {version} bench, {os.cpu_count()} CPUs, "
                 f"{platform.machine()}; ratios from one run", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
