"""The bench as a package (layering, registry, targets as data), its report
(the verdict line, which way each ratio is good), the plot's panels, the
warm-up pass, and the command line's edges (--plot without matplotlib, more
threads than CPUs, a closed pipe). No timing assertions."""
import ast
import json
import pkgutil
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ferrox_kv.bench
from ferrox_kv.bench import runner
from ferrox_kv.bench.common import GEOMETRIES
from ferrox_kv.bench.harness import Results, best_of
from ferrox_kv.bench.plot import panels
from ferrox_kv.bench.report import report
from ferrox_kv.bench.targets import evaluate, verdict_line

REPO = Path(__file__).resolve().parents[1]
PKG = Path(ferrox_kv.bench.__file__).parent
GROUP_FILES = sorted(p.stem for p in (PKG / "groups").glob("*.py") if p.stem != "__init__")
BELOW_GROUPS = {"ferrox_kv.bench.common", "ferrox_kv.bench.harness", "ferrox_kv.bench.targets",
                "ferrox_kv.bench.llama"}


def _modules():
    """{module name: source path} of every module of the installed bench package."""
    out = {"ferrox_kv.bench": PKG / "__init__.py"}
    for info in pkgutil.walk_packages([str(PKG)], "ferrox_kv.bench."):
        mod = __import__(info.name, fromlist=["_"]) if info.name != "ferrox_kv.bench.__main__" \
            else None
        path = Path(mod.__file__) if mod is not None else PKG / "__main__.py"
        out[info.name] = path
    return out


def _bench_imports(path, known):
    """The modules of the bench that ``path`` imports, anywhere in it."""
    got = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            got.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            got.add(node.module)
            got.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in got if m in known}


def _graph():
    mods = _modules()
    graph = {m: _bench_imports(p, mods) - {m} for m, p in mods.items()}
    # the runner imports its groups by name, from its registry
    graph["ferrox_kv.bench.runner"] |= {f"ferrox_kv.bench.groups.{g}"
                                        for g in runner.GROUP_MODULES}
    return graph


# ---------------------------------------------------------------------------
# the package
# ---------------------------------------------------------------------------

def test_bench_modules_import_one_another_without_a_cycle():
    graph = _graph()
    state = {}

    def visit(m, path):
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", "import cycle: " + " -> ".join(path + [m])
        state[m] = "open"
        for n in sorted(graph[m]):
            visit(n, path + [m])
        state[m] = "done"

    for m in sorted(graph):
        visit(m, [])


def test_groups_import_only_the_modules_below_them():
    graph = _graph()
    assert GROUP_FILES, "no group modules found"
    for g in GROUP_FILES:
        name = f"ferrox_kv.bench.groups.{g}"
        assert graph[name] <= BELOW_GROUPS, (name, graph[name] - BELOW_GROUPS)
    for below in BELOW_GROUPS:
        assert not any(m.startswith("ferrox_kv.bench.groups") or m.endswith(
            (".runner", ".report", ".plot")) for m in graph[below]), (below, graph[below])
    importers = {m for m, deps in graph.items() if "ferrox_kv.bench.runner" in deps}
    assert importers <= {"ferrox_kv.bench", "ferrox_kv.bench.__main__"}, importers


@pytest.mark.parametrize("group", GROUP_FILES)
def test_each_group_module_imports_alone(group):
    code = (f"import sys, json; import ferrox_kv.bench.groups.{group} as g; "
            "print(json.dumps([g.GROUP.slug, sorted(m for m in sys.modules "
            "if m.startswith('ferrox_kv.bench'))]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=REPO / "tests")
    assert p.returncode == 0, p.stderr
    slug, loaded = json.loads(p.stdout.splitlines()[-1])
    others = {f"ferrox_kv.bench.groups.{o}" for o in GROUP_FILES if o != group}
    assert not (set(loaded) & (others | {"ferrox_kv.bench.runner", "ferrox_kv.bench.report",
                                          "ferrox_kv.bench.plot"})), loaded
    assert slug in runner.GROUPS


def test_the_registry_is_the_one_list_of_groups():
    # every module of groups/ is registered, once, and the groups keep their slugs
    assert sorted(runner.GROUP_MODULES) == GROUP_FILES
    assert list(runner.GROUPS) == ["push", "extend", "pool", "threads", "decode", "attention",
                                   "sharing", "memory", "hf", "precision", "capacity", "store"]
    assert ferrox_kv.bench.GROUPS is runner.GROUPS


def test_the_wheel_lists_every_bench_package():
    text = (REPO / "pyproject.toml").read_text()
    listed = set(re.search(r"^packages = \[(.*)\]", text, re.M).group(1).replace('"', "")
                 .replace(" ", "").split(","))
    packages = {"ferrox_kv"} | {m for m in _modules() if (Path(
        __import__(m, fromlist=["_"]).__file__).name == "__init__.py")
        if m != "ferrox_kv.bench.__main__"}
    assert packages <= listed, packages - listed


def _synthetic_results():
    """A row for every slug a target is set on, at the contexts and
    geometries that give those targets goals."""
    res = Results()
    for geo in GEOMETRIES:
        res.add("push", geo, "push.floor", "floor", 100.0, "ns/pos")
        for slug in ("push.with_capacity.vs_floor", "push.with_capacity.vs_numpy"):
            res.add("push", geo, slug, "push", 90.0, "ns/pos", 0.9, "floor")
        res.add("push", geo, "push.pooled.vs_unpooled", "pooled", 95.0, "ns/pos", 1.0, "x",
                vs_floor=0.95)
        res.add("extend", geo, "extend.with_capacity.vs_floor", "extend", 10.0, "GB/s", 1.0,
                "floor")
        res.add("extend", geo, "extend.pooled.vs_floor", "extend", 10.0, "GB/s", 1.0, "floor")
        for work in ("push", "extend", "push_layers", "floor"):
            for regime in ("cached", "stream"):
                res.add("threads", geo, f"threads.{work}.{regime}", "t", 1.0, "Mpos/s", 1.9,
                        "1 thread", threads=2, regime=regime)
    for slug in ("sharing.fork_blocks", "sharing.prefix_blocks", "sharing.hit_vs_extend",
                 "sharing.bookkeeping", "sharing.chat_prefill"):
        res.add("sharing", "8x128", slug, "s", 1.0, "blocks", 0.001, "x")
    res.add("decode", "llama8b", "decode.dynamic_cache", "dc", 1.0, "us/token", 500.0, "x",
            context=2048)
    for T in (512, 2048, 8192):
        for slug in ("attention.attend.vs_sdpa", "attention.attend.vs_gather",
                     "attention.attend.vs_floor", "attention.threads2.vs_floor"):
            res.add("attention", "llama8b", slug, "a", 1.0, "us/call", 1.0, "x", context=T,
                    read_gbs=10.0)
        for slug in ("attention.mem.attend.vs_sdpa", "attention.mem.attend.vs_floor",
                     "attention.mem.attend.vs_1thread"):
            res.add("attention", "llama8b", slug, "a", 1.0, "us/call", 1.0, "x", context=T,
                    threads=2, memory=True, floor_vs_sdpa=0.3)
    res.add("precision", "llama8b", "precision.attend.float32", "p", 1.0, "us/call", 1.0, "x",
            dtype="float32", context=8192, threads=2)
    for T in (128, 2048, 8192):
        res.add("hf", "llama-2L", "hf.ferrox.vs_dynamic", "hf", 1.0, "ms/token", 0.5, "x",
                context=T)
    return res


def _all_targets(res):
    return [t for g in runner.GROUPS.values() for t in g.targets(res)]


def test_every_target_with_a_goal_is_explained_in_notes_by_its_slug():
    notes = (REPO / "benchmarks" / "NOTES.md").read_text()
    targets = [t for t in _all_targets(_synthetic_results()) if t.goal is not None]
    assert len(targets) >= 30
    missing = sorted({t.slug for t in targets if f"### `{t.slug}`" not in notes})
    assert not missing, missing


# ---------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------

def _threads_res(ext_stream, floor_stream, push_cached):
    res = Results()
    res.add("threads", "llama8b", "threads.extend.stream", "e", 1.0, "Mpos/s", ext_stream,
            "1 thread", threads=2)
    res.add("threads", "llama8b", "threads.floor.stream", "f", 1.0, "Mpos/s", floor_stream,
            "1 thread", threads=2)
    res.add("threads", "wide", "threads.push.cached", "p", 1.0, "Mpos/s", push_cached,
            "1 thread", threads=2)
    res.add("push", "small", "push.with_capacity.vs_numpy", "p", 1.0, "ns/pos", 0.3, "numpy")
    return res


def test_verdict_counts_misses_the_hardware_floor_also_misses():
    res = _threads_res(ext_stream=1.2, floor_stream=1.3, push_cached=0.9)
    ev = evaluate(_all_targets(res), res)
    judged = {(v.target.slug, v.target.where.get("geometry")): v for v in ev if v.verdict}
    assert len(judged) == 3
    bound = judged["threads.extend.stream", "llama8b"]
    assert bound.verdict == "MISSED" and bound.hardware_bound
    assert "benchmarks/NOTES.md, target threads.extend.stream" in bound.hint
    assert "1.30x" in bound.hint       # the floor's own scaling, from this run
    code = judged["threads.push.cached", "wide"]
    assert code.verdict == "MISSED" and not code.hardware_bound
    assert code.hint == "benchmarks/NOTES.md, target threads.push.cached"
    assert verdict_line(ev) == ("verdict: 1 of 3 targets met, 2 missed, 1 of them "
                                "hardware-bound on this machine (the C floor itself misses "
                                "the goal)")
    # the floor scaling well makes the same miss ferrox's own
    res = _threads_res(ext_stream=1.2, floor_stream=1.9, push_cached=1.8)
    ev = evaluate(_all_targets(res), res)
    assert verdict_line(ev).startswith("verdict: 2 of 3 targets met, 1 missed, 0 of them")


def test_report_opens_with_the_verdict_line_and_says_which_way_each_ratio_is_good():
    res = _threads_res(ext_stream=1.8, floor_stream=1.9, push_cached=1.8)
    res.add("attention", "llama8b", "attention.attend.vs_gather", "attend", 900.0, "us/call",
            7.0, "speed-up over gather+SDPA", better="higher", context=2048)
    groups = [runner.GROUPS[g] for g in ("push", "threads", "attention")]
    ev = evaluate([t for g in groups for t in g.targets(res)], res)
    text, doc = report(res, groups, ev, "header")
    lines = text.splitlines()
    assert lines[0] == "verdict: all 4 targets met" and lines[1] == "header"
    assert all(d["hardware_bound"] is False for d in doc)
    header = next(ln for ln in lines if ln.startswith("geometry"))
    assert re.search(r"ratio\s+better\s+of$", header)
    rows = {r["slug"]: r for r in res.rows}
    assert rows["threads.extend.stream"]["better"] == "higher"       # a rate
    assert rows["push.with_capacity.vs_numpy"]["better"] == "lower"  # a time
    assert rows["attention.attend.vs_gather"]["better"] == "higher"  # a speed-up of a time
    gather = next(ln for ln in lines if "speed-up over gather" in ln)
    assert re.search(r"7\.00\s+higher\s+speed-up", gather)
    assert Results().add("g", "-", "s", "n", 1.0, "MiB")["better"] is None   # no ratio


def test_every_row_of_a_run_says_which_way_its_ratio_is_good(tmp_path):
    path = tmp_path / "b.json"
    p = subprocess.run([sys.executable, "-m", "ferrox_kv", "bench", "--quick", "--groups",
                        "push,extend,pool,memory", "--geometry", "small", "--json", str(path)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0].startswith("verdict: ")
    doc = json.loads(path.read_text())
    assert doc["schema"] == 2 and doc["verdict"] == p.stdout.splitlines()[0]
    with_ratio = [r for r in doc["results"] if r["ratio"] is not None]
    assert with_ratio and all(r["better"] in ("lower", "higher") for r in with_ratio)
    assert {r["better"] for r in with_ratio if r["group"] == "extend"} == {"higher"}
    assert {r["better"] for r in with_ratio if r["group"] == "push"} == {"lower"}
    assert all("hardware_bound" in t for t in doc["targets"])


# ---------------------------------------------------------------------------
# the plot
# ---------------------------------------------------------------------------

def test_plot_has_one_panel_per_question_and_targets_only_where_they_apply():
    res = _synthetic_results()
    ps = panels(res, evaluate(_all_targets(res), res))
    assert [p["title"][:3] for p in ps] == ["(a)", "(b)", "(c)"]
    push, extend = ps[1], ps[2]
    assert "push" in push["title"] and "time" in push["ylabel"]
    assert "lower is better" in push["ylabel"]
    assert "extend" in extend["title"] and "bandwidth" in extend["ylabel"]
    assert "higher is better" in extend["ylabel"]
    # each panel's geometries: all three; each target: at the one it is set on
    assert push["geos"] == extend["geos"] == list(GEOMETRIES)
    assert push["targets"] == [("llama8b", "<=", 1.25)]
    assert extend["targets"] == [("llama8b", ">=", 0.8)]
    # the pooled push bar is its time over the floor's; its target (vs
    # unpooled) is another ratio, so it is not drawn there
    assert ("llama8b", "push, with_pool (pool in use)", 0.95) in push["bars"]
    assert all(p["kind"] != "bars" or all(b[0] in p["geos"] for b in p["bars"]) for p in ps)


def _with_precision_rows(res):
    for dt, b, a in (("float32", 1.0, 1.0), ("float16", 0.5, 0.9), ("bfloat16", 0.5, 1.1),
                     ("int8", 0.266, 2.5)):
        res.add("precision", "llama8b", f"precision.bytes.{dt}", "b", 1.0, "B", b, "float32",
                dtype=dt)
        for ctx in (2048, 8192):
            res.add("precision", "llama8b", f"precision.attend.{dt}", "a", 1.0, "us/call",
                    a * ctx / 8192, "float32", dtype=dt, context=ctx)
    return res


def test_plot_adds_a_dtype_panel_when_the_precision_group_ran():
    res = _with_precision_rows(_synthetic_results())
    ps = panels(res, evaluate(_all_targets(res), res))
    assert [p["title"][:3] for p in ps] == ["(a)", "(b)", "(c)", "(d)"]
    d = ps[3]
    assert d["kind"] == "dtypes" and d["dtypes"] == ["float32", "float16", "bfloat16", "int8"]
    (blabel, by), (alabel, att) = d["series"]
    assert "bytes" in blabel and by["int8"] == 0.266
    assert "8192" in alabel and att == {"float32": 1.0, "float16": 0.9, "bfloat16": 1.1,
                                        "int8": 2.5}


def test_plot_adds_a_threads_panel_and_n_thread_targets_when_attention_ran_at_two_counts():
    res = _synthetic_results()
    for n, attend, sdpa, floor in ((1, 900.0, 1800.0, 600.0), (2, 500.0, 1000.0, 300.0)):
        for slug, v in (("attention.attend.vs_floor", attend), ("attention.sdpa", sdpa),
                        ("attention.floor", floor)):
            res.add("attention", "llama8b", slug, "x", v, "us/call", v / floor, "read floor",
                    context=16384, threads=n)
        res.add("attention", "llama8b", "attention.attend.vs_sdpa", "x", attend, "us/call",
                attend / sdpa, "SDPA", context=16384, threads=n)
    res.add("attention", "llama8b", "attention.attend.vs_1thread", "x", 500.0, "us/call",
            500 / 900, "1 thread", context=16384, threads=2)
    ps = panels(res, evaluate(_all_targets(res), res))
    e = ps[-1]
    assert e["title"].startswith("(e)") and e["dtypes"] == ["1 thread", "2 threads"]
    got = dict(e["series"])
    assert got["ferrox attend, pooled, in place"] == {"1 thread": 1.0, "2 threads": 500 / 900}
    assert got["read floor (K+V read once, C)"]["2 threads"] == 0.5
    # the 1-thread lines of panel (a) keep one point per context
    assert all(len({x for x, _ in s["points"]}) == len(s["points"]) for s in ps[0]["series"])
    judged = {(v.target.slug, v.target.where.get("threads")): v for v in evaluate(_all_targets(res), res)
              if v.target.where.get("context") == 16384}
    assert judged["attention.attend.vs_1thread", 2].target.goal == 0.6
    assert judged["attention.attend.vs_1thread", 2].verdict == "met"
    assert judged["attention.attend.vs_sdpa", 2].target.goal == 0.5


def test_plot_draws_three_panels_when_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    from ferrox_kv.bench.plot import plot
    res = _synthetic_results()
    plot(res, tmp_path / "p.png", evaluate(_all_targets(res), res), "test")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _with_precision_rows(res)
    plot(res, tmp_path / "p4.png", evaluate(_all_targets(res), res), "test")
    assert (tmp_path / "p4.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------
# the warm-up pass
# ---------------------------------------------------------------------------

def test_best_of_times_nothing_of_a_warm_up_pass():
    calls = []

    def run(_):
        calls.append(1)
        if len(calls) == 1:        # the first call of a variant is slow (cold)
            time.sleep(0.3)

    best = best_of([("v", lambda: None, run)], reps=1)
    assert len(calls) == 2
    assert best["v"] < 0.15, best


# ---------------------------------------------------------------------------
# the command line's edges
# ---------------------------------------------------------------------------

def test_oversubscribed_threads_warning_names_the_threads_and_the_cpus():
    from ferrox_kv.bench.groups.threads import oversubscribed
    assert oversubscribed(2, cpus=2) is None
    msg = oversubscribed(16, cpus=2)
    assert msg.startswith("warning: --threads 16 exceeds the 2 CPUs") and "time-slicing" in msg


def test_thread_scaling_warns_past_the_cpus_and_shows_progress(tmp_path):
    from ferrox_kv.bench.harness import thread_counts, usable_cpus
    n = usable_cpus() + 1
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "thread_scaling.py"),
                        "--threads", str(n), "--quick", "--geometry", "small"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert f"warning: --threads {n} exceeds the {usable_cpus()} CPU" in p.stderr
    assert p.stderr.index("warning:") < p.stderr.index("run 1/")     # before the work
    # one progress line per timed run: 2 regimes x 4 works x 2 reps x the counts
    runs = re.findall(r"threads small \[(cached|stream)\] \w+ \(\d/4\): \d+ threads?, "
                      r"run (\d+)/(\d+)", p.stderr)
    per = 2 * len(thread_counts(n))
    assert len(runs) == 2 * 4 * per and {int(t) for _, _, t in runs} == {per}
    assert "== threads" in p.stdout


@pytest.mark.parametrize("argv", [["-m", "ferrox_kv", "info"],
                                  ["-m", "ferrox_kv.bench", "--quick", "--groups", "pool"]])
def test_a_closed_pipe_ends_the_command_quietly(argv, tmp_path):
    """`ferrox-kv info | head`: the reader is gone before the command
    writes; no traceback, the status of a tool killed by SIGPIPE."""
    p = subprocess.Popen([sys.executable, *argv], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()               # the reader leaves before anything is written
    _, err = p.communicate(timeout=300)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()
    assert p.returncode == 141, err.decode()


def test_plot_without_matplotlib_refuses_before_any_group_runs(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; "
            "from ferrox_kv.bench.runner import main; "
            "sys.exit(main(['--groups', 'push,extend,pool,threads', '--plot', 'x.png']))")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
    assert "--plot needs matplotlib" in p.stderr and "pip install '.[plot]'" in p.stderr
    assert "[bench" not in p.stderr                 # no group started
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("width,goals", [(8, {"float16": 0.8, "bfloat16": 0.8, "int8": 0.7, "int4": 1.0}),
                                         (16, {"float16": 0.6, "bfloat16": 0.6, "int8": 0.45, "int4": 1.0})])
def test_the_precision_attend_goals_follow_the_width_the_rows_ran_at(width, goals):
    from ferrox_kv.bench.groups.precision import targets
    res = Results()
    for dt in ("float32", "float16", "bfloat16", "int8"):
        res.add("precision", "llama8b", f"precision.attend.{dt}", "a", 1.0, "us/call", 1.0,
                "float32", dtype=dt, context=8192, simd_width=width)
    got = {t.where["dtype"]: t.goal for t in targets(res) if t.slug.startswith("precision.attend.")}
    assert got == goals
    assert all(("AVX-512" in t.label) == (width == 16) for t in targets(res)
               if t.slug.startswith("precision.attend."))


def test_the_int8_fit_target_is_on_bytes_and_is_met():
    """Whole 2048 x 32-layer sequences cannot reach 3.7x in int8 (the 8th
    misses by 0.47 of one), so that target missed in every run: the target
    is on bytes, 3.76x, which the storage contract gives."""
    from ferrox_kv.bench.groups.precision import fit_rows, targets
    from ferrox_kv.bench.targets import evaluate
    res = Results()
    fit_rows(res)
    got = {v.target.slug: v for v in evaluate(targets(res), res)}
    v = got["precision.fit_bytes.int8"]
    assert v.target.goal == 3.76 and v.verdict == "met" and 3.76 <= v.value < 3.77
    assert "precision.fit.int8" not in got
    assert all(x.verdict == "met" for x in got.values()), got


def test_each_decode_goal_is_set_back_to_back_and_from_memory():
    """The N-thread decode goals hold for both measurements: calls back to
    back (a context the caches hold) and single calls after the caches
    were evicted (a model's decode)."""
    targets = _all_targets(_synthetic_results())
    goals = {(t.slug, tuple(sorted(t.where.items()))): t.goal for t in targets if t.goal}
    pairs = [("attention.attend.vs_sdpa", "attention.mem.attend.vs_sdpa"),
             ("attention.attend.vs_floor", "attention.mem.attend.vs_floor"),
             ("attention.attend.vs_1thread", "attention.mem.attend.vs_1thread")]
    pairs += [(f"precision.{k}.{dt}", f"precision.mem.{k}.{dt}")
              for k in ("attend", "attend_floor") for dt in ("float16", "bfloat16", "int8")]
    pairs += [(f"precision.attend_sdpa.{dt}", f"precision.mem.attend_sdpa.{dt}")
              for dt in ("float32", "bfloat16")]
    plain = {k: v for k, v in goals.items() if ".mem." not in k[0]}
    mem = {k: v for k, v in goals.items() if ".mem." in k[0]}
    for a, b in pairs:
        at = {where: g for (slug, where), g in mem.items() if slug == b}
        assert at, b
        for where, g in at.items():
            assert plain.get((a, where), g) == g
    assert any(t.slug == "precision.mem.attend.int8" and t.goal == 0.5
               and t.where["context"] == 8192 and t.where["threads"] == 2 for t in targets)


@pytest.mark.parametrize("floor,bound", [(0.55, True), (0.3, False)])
def test_a_from_memory_sdpa_miss_is_the_hardwares_where_the_read_floor_misses_too(floor, bound):
    from ferrox_kv.bench.groups.attention import targets
    res = Results()
    res.add("attention", "llama8b", "attention.mem.attend.vs_sdpa", "a", 1.0, "us/call", 0.6,
            "SDPA from memory", context=2048, threads=2, memory=True, floor_vs_sdpa=floor)
    (v,) = [v for v in evaluate(targets(res), res) if v.verdict]
    assert v.verdict == "MISSED" and v.hardware_bound is bound
    assert f"the read floor vs SDPA {floor}" in v.hint


@pytest.mark.parametrize("slug,group", [("hf.ferrox.vs_dynamic", "hf"), ("precision.hf_bf16", "precision")])
@pytest.mark.parametrize("bound_ratio,bound", [(0.65, True), (0.55, False)])
def test_an_hf_miss_is_the_hardwares_where_floor_plus_kv_read_misses_too(slug, group, bound_ratio, bound):
    """The model's per-token floor plus the K/V read from memory, over
    DynamicCache's step, estimates the least a step can take: a miss is
    the hardware's only where that misses the goal (0.6 at 2048) too."""
    import importlib
    targets = importlib.import_module(f"ferrox_kv.bench.groups.{group}").targets
    res = Results()
    res.add(group, "llama-2L", slug, "a", 10.0, "ms/token", 0.7, "DynamicCache", context=2048,
            threads=2, floor_ms=5.0, kv_floor_ms=1.0, bound_ratio=bound_ratio)
    (v,) = [v for v in evaluate(targets(res), res) if v.verdict and v.target.slug == slug]
    assert v.verdict == "MISSED" and v.hardware_bound is bound
    assert f"model floor + K/V read from memory, vs DynamicCache {bound_ratio:.3f}x" in v.hint


def test_llc_bytes_takes_the_largest_cache_of_sysfs(tmp_path):
    from ferrox_kv.bench.harness import llc_bytes
    for name, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "480M"), ("junk", "x")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "size").write_text(size + "\n")
    assert llc_bytes(str(tmp_path)) == 480 << 20
    assert llc_bytes(str(tmp_path / "none")) == 256 << 20


def test_from_memory_rows_time_single_calls_after_an_eviction(monkeypatch):
    """Both groups' from-memory rows: every variant's call comes after
    ``evict_caches`` (counted), with ratios of that run's own figures."""
    import numpy as np

    from ferrox_kv import KvBlockPool, KvCache
    from ferrox_kv.bench import harness
    from ferrox_kv.bench.groups import attention, precision
    calls = []
    monkeypatch.setattr(harness, "_EVICT", [])
    monkeypatch.setattr(harness, "llc_bytes", lambda: 1 << 20)

    evict = harness.evict_caches

    def counted():
        calls.append(1)
        return evict()
    monkeypatch.setattr(harness, "evict_caches", counted)
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((48, 8, 128), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((32, 128), dtype=np.float32)
    cache = KvCache.with_pool(8, 128, KvBlockPool(16, 3, 8, 128), 48)
    cache.extend(k, v)
    res = Results()
    attention._from_memory(res, cache, q, np.empty((32, 128), np.float32), 1, 1, None, 48)
    assert len(calls) == 2 * 4          # attend and the floor, 1 warm-up + 3 timed each
    assert harness._EVICT[0].nbytes == 2 << 20
    rows = {r["slug"]: r for r in res.rows}
    assert set(rows) == {"attention.mem.floor", "attention.mem.attend.vs_floor"}
    r = rows["attention.mem.attend.vs_floor"]
    assert r["memory"] and r["ratio"] == r["value"] / rows["attention.mem.floor"]["value"]
    calls.clear()
    caches = {"float32": cache}
    precision._decode_from_memory(res, caches, q, 48, 1, 1, [])
    assert len(calls) == 2 * 4
    got = {r["slug"] for r in res.rows if r["slug"].startswith("precision.mem.")}
    assert got == {"precision.mem.attend.float32", "precision.mem.attend_floor.float32"}
    calls.clear()
    precision._decode_from_memory(res, caches, q, 48, 1, 1, [("sdpa.float32", lambda: None)])
    assert len(calls) == 3 * 4          # SDPA's call too
    (r,) = [r for r in res.rows if r["slug"] == "precision.mem.attend_sdpa.float32"]
    assert r["memory"] and r["floor_vs_sdpa"] > 0
    cache.close()


@pytest.mark.parametrize("cpus", [1, 3])
def test_evict_caches_reads_the_whole_buffer_split_over_the_usable_cpus(monkeypatch, cpus):
    import threading

    from ferrox_kv.bench import harness
    monkeypatch.setattr(harness, "_EVICT", [])
    monkeypatch.setattr(harness, "llc_bytes", lambda: 1 << 20)
    monkeypatch.setattr(harness, "usable_cpus", lambda: cpus)
    started = []
    real = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda t: (started.append(t), real(t))[1])
    assert harness.evict_caches() == (2 << 20) // 4 // 16     # every 16th float of 2 MiB of ones
    assert len(started) == cpus - 1                           # the caller reads one part itself
