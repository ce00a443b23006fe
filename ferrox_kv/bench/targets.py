"""Targets as data: a goal on one row's ratio, the figures of the same run
worth reading beside a miss, and the hardware floor that tells a miss the
hardware imposes from one the code does. Each group module lists its own
targets; why a target is missed is written in ``benchmarks/NOTES.md``, under
the target's slug, not here. Imports only the harness."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ferrox_kv.bench.harness import fmt_num

NOTES = "benchmarks/NOTES.md"


@dataclass
class Figure:
    """A figure of this run: ``row[field]`` of the row ``slug``/``where``."""
    label: str
    slug: str
    where: dict = field(default_factory=dict)
    field: str = "ratio"
    unit: str = ""

    def read(self, res):
        r = res.find(self.slug, **self.where)
        return None if r is None else r.get(self.field)

    def text(self, res):
        v = self.read(res)
        return f"{self.label} {'?' if v is None else fmt_num(v)}{self.unit}"


@dataclass
class Target:
    label: str
    slug: str
    op: str                     # "<=", ">=", or "info"
    goal: float | None
    where: dict = field(default_factory=dict)
    related: list = field(default_factory=list)   # [Figure] printed beside a miss
    # the hardware's own figure for the same question (a C floor's 2-thread
    # scaling): a miss is hardware-bound when that figure misses the goal too
    bound_by: Figure | None = None
    value: Callable | None = None   # computes the value from the results instead


def step_bound(slug, at):
    """A model row's least step (its per-token floor plus its K/V read from
    memory, the row's ``bound_ratio``) over DynamicCache's step: a miss is
    hardware-bound where this misses the goal too."""
    return Figure("model floor + K/V read from memory, vs DynamicCache", slug, at, field="bound_ratio",
                  unit="x")


@dataclass
class Verdict:
    target: Target
    value: float
    verdict: str                # "met", "MISSED", or "" for information
    hint: str                   # on a miss: where it is explained, and related figures
    hardware_bound: bool


def meets(op, value, goal):
    return value <= goal if op == "<=" else value >= goal


def evaluate(targets, res):
    """[Verdict] for every target this run has a figure for."""
    out = []
    for t in targets:
        value = t.value(res) if t.value else res.ratio(t.slug, **t.where)
        if value is None:
            continue
        verdict, hint, bound = "", "", False
        if t.op != "info":
            verdict = "met" if meets(t.op, value, t.goal) else "MISSED"
        if verdict == "MISSED":
            hw = t.bound_by.read(res) if t.bound_by is not None else None
            bound = hw is not None and not meets(t.op, hw, t.goal)
            figures = [f.text(res) for f in t.related]
            if t.bound_by is not None:
                figures.insert(0, t.bound_by.text(res))
            hint = f"{NOTES}, target {t.slug}" + (
                f" (this run: {'; '.join(figures)})" if figures else "")
            if bound:
                hint = "hardware-bound: " + hint
        out.append(Verdict(t, value, verdict, hint, bound))
    return out


def verdict_line(evaluated):
    """One line: how many targets were met, missed, and how many of the
    misses the hardware itself imposes on this machine."""
    judged = [v for v in evaluated if v.verdict]
    if not judged:
        return "verdict: no targets apply to the groups of this run"
    missed = [v for v in judged if v.verdict == "MISSED"]
    if not missed:
        return f"verdict: all {len(judged)} target{'s' if len(judged) > 1 else ''} met"
    bound = sum(v.hardware_bound for v in missed)
    return (f"verdict: {len(judged) - len(missed)} of {len(judged)} targets met, "
            f"{len(missed)} missed, {bound} of them hardware-bound on this machine "
            "(the C floor itself misses the goal)")
