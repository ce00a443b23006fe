"""The text report: the verdict line, the legend, one table per group, and
the targets with, for each miss, where it is explained."""
from __future__ import annotations

from ferrox_kv.bench.common import LEGEND
from ferrox_kv.bench.harness import fmt_num
from ferrox_kv.bench.targets import verdict_line


def targets_text(evaluated):
    """The targets table, and its rows as JSON-ready dicts."""
    if not evaluated:
        return "", []
    label_w = max(len(v.target.label) for v in evaluated)
    lines = ["\n== targets (this run)",
             f"{'target':<{label_w}}  {'value':>7}  {'goal':<7}  verdict"]
    doc = []
    for v in evaluated:
        t = v.target
        goal_s = "" if t.goal is None else f"{t.op} {t.goal:g}"
        lines.append(f"{t.label:<{label_w}}  {fmt_num(v.value):>7}  {goal_s:<7}  "
                     f"{v.verdict}".rstrip())
        if v.hint:
            lines.append(f"{'':<4}why: {v.hint}")
        doc.append({"target": t.label, "slug": t.slug, "where": t.where, "value": v.value,
                    "goal": goal_s, "met": v.verdict == "met", "hint": v.hint,
                    "hardware_bound": v.hardware_bound})
    return "\n".join(lines), doc


def report(res, groups, evaluated, header, skipped=None):
    """The whole report as text: the verdict line first, then ``header``, the
    legend, the skipped line, one table per group (``groups``: [Group]) and
    the targets; and the targets' JSON rows."""
    parts = [verdict_line(evaluated), header, LEGEND]
    if skipped:
        parts.append(skipped)
    for g in groups:
        text = res.table(g.slug, g.title)
        if text:
            parts.append(text)
    target_text, doc = targets_text(evaluated)
    parts.append(target_text)
    return "\n".join(parts), doc
