"""The ``ferrox-kv`` command and the bench's report (no timing assertions).

The commands run in a subprocess of this interpreter (``sys.executable -m
ferrox_kv``) from a temporary directory, so they import the installed
package, as a user's shell would, and never the source tree."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

import ferrox_kv
from ferrox_kv.bench import Results, fmt_num, fmt_quantity

SCI = re.compile(r"\d\.?\d*[eE][+-]?\d")
HIDE = "import sys\nfor _m in {mods!r}:\n    sys.modules[_m] = None\n"


def run_cli(tmp_path, *args, hide=(), module="ferrox_kv"):
    """Run ``python -m <module> args`` (with the modules in ``hide`` made
    unimportable); return (returncode, stdout, stderr)."""
    if hide:
        code = (HIDE.format(mods=list(hide)) + "import runpy\n"
                f"sys.argv = [{module!r}] + {list(args)!r}\n"
                f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")
        cmd = [sys.executable, "-c", code]
    else:
        cmd = [sys.executable, "-m", module, *args]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    return p.returncode, p.stdout, p.stderr


# ---------------------------------------------------------------------------
# numbers
# ---------------------------------------------------------------------------

def test_fmt_num_never_prints_scientific_notation():
    for exp in range(-15, 19):
        for mantissa in (1.0, 1.2634, 4.9999, 9.9996, 99.96):
            for x in (mantissa * 10.0 ** exp, -mantissa * 10.0 ** exp):
                s = fmt_num(x)
                assert "e" not in s.lower() or s in ("inf", "-inf"), (x, s)
                assert not SCI.search(s), (x, s)


def test_fmt_num_keeps_about_three_significant_digits():
    assert fmt_num(955.0) == "955"
    assert fmt_num(1.2345) == "1.23"
    assert fmt_num(12.345) == "12.3"
    assert fmt_num(0.8861) == "0.886"
    assert fmt_num(12345678.0) == "12345678"
    assert fmt_num(0.0001) == "<0.001"
    assert fmt_num(0) == "0"
    assert fmt_num(None) == ""
    assert fmt_num(float("nan")) == "n/a"


@pytest.mark.parametrize("value, unit, expected", [
    (12634.0, "us/token", "12.6 ms/token"),       # was printed as 1.263e+04 us/token
    (1495.0, "ns/pos", "1.50 µs/pos"),
    (71.6, "ns/pos", "71.6 ns/pos"),
    (0.5, "us/call", "500 ns/call"),
    (38200.0, "ms/token", "38.2 s/token"),
    (47.6, "GB/s", "47.6 GB/s"),
    (0.5, "GB/s", "500 MB/s"),
    (0.276, "Mpos/s", "276 kpos/s"),
    (1024.0, "MiB", "1.00 GiB"),
    (0.008, "MiB", "8.19 KiB"),
    (8257536, "B", "7.88 MiB"),
    (1.13, "x", "1.13x"),
])
def test_fmt_quantity_picks_a_sensible_unit(value, unit, expected):
    got = fmt_quantity(value, unit)
    assert got in (expected, expected.replace("µs", "us")), got


def test_fmt_quantity_never_prints_scientific_notation():
    for unit in ("ns/pos", "us/token", "ms/token", "GB/s", "Mpos/s", "MiB", "B", "x", "ns/block"):
        for exp in range(-12, 16):
            s = fmt_quantity(3.3 * 10.0 ** exp, unit)
            assert not SCI.search(s), (unit, exp, s)


def test_table_columns_line_up_and_long_names_wrap():
    res = Results()
    res.add("g", "llama8b", "g.a", "short", 1495.0, "ns/pos", 0.886, "floor")
    res.add("g", "llama8b", "g.b", "a measure name far longer than the column allows, "
            "so it wraps", 12634.0, "us/token", 955.0, "numpy")
    res.add("g", "wide", "g.c", "mid-sized name", 47.6, "GB/s")
    lines = res.table("g", "title", name_width=30).splitlines()
    assert lines[1] == "== g: title"
    data = [ln for ln in lines[3:] if not ln.startswith(" ")]
    assert len(data) == 3
    # the value column ends at one offset on every row
    ends = {ln.index(u) + len(u) for ln, u in zip(data, ["s/pos", "ms/token", "GB/s"])}
    assert len(ends) == 1, lines
    assert any(ln.startswith(" ") and "wraps" in ln for ln in lines[3:])
    assert not any(SCI.search(ln) for ln in lines)


# ---------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------

def test_info_prints_simd_path_and_thresholds(tmp_path):
    rc, out, err = run_cli(tmp_path, "info")
    assert rc == 0, err
    assert f"ferrox_kv {ferrox_kv.__version__}" in out
    assert ferrox_kv.simd_path() in out
    assert str(ferrox_kv.gil_release_threshold()) in out
    assert str(ferrox_kv.attend_gil_release_threshold()) in out
    assert "numpy" in out and "CPUs" in out and "build" in out


def test_bench_push_quick_writes_json_with_slugs(tmp_path):
    path = tmp_path / "bench.json"
    rc, out, err = run_cli(tmp_path, "bench", "--quick", "--groups", "push",
                           "--geometry", "small", "--json", str(path))
    assert rc == 0, err
    doc = json.loads(path.read_text())
    rows = doc["results"]
    assert rows and {r["group"] for r in rows} == {"push"}
    assert all(r["slug"].startswith("push.") for r in rows)
    slugs = {r["slug"] for r in rows}
    assert {"push.floor", "push.with_capacity.vs_floor", "push.with_capacity.vs_numpy"} <= slugs
    target = next(t for t in doc["targets"] if t["slug"] == "push.with_capacity.vs_numpy")
    assert target["goal"] == "<= 0.45" and isinstance(target["value"], float)
    # the report: a legend, the table, the targets; no scientific notation
    assert "floor" in out and "[cached]" in out and "llama8b" in out
    assert "== push" in out and "== targets" in out
    assert not SCI.search(out), out


def test_bench_alias_python_m_ferrox_kv_bench(tmp_path):
    rc, out, err = run_cli(tmp_path, "--quick", "--groups", "pool", module="ferrox_kv.bench")
    assert rc == 0, err
    assert "== pool" in out


def test_bench_without_torch_names_what_it_skipped_in_one_line(tmp_path):
    rc, out, err = run_cli(tmp_path, "bench", "--quick", "--groups", "push,decode,hf",
                           "--geometry", "small", "--contexts", "16",
                           hide=("torch", "transformers"))
    assert rc == 0, err
    lines = [ln for ln in out.splitlines() if "skipped" in ln]
    assert len(lines) == 1, out
    line = lines[0]
    assert "pip install '.[hf]'" in line
    assert "hf group" in line and "DynamicCache" in line
    # everything that does not need torch ran
    assert "== push" in out and "== decode" in out and "== hf" not in out


def test_bench_without_the_store_extra_says_so_in_its_report(tmp_path):
    """The README's first command installs only [hf]: the store group was
    skipped with a progress line only. The report names it and the fix."""
    rc, out, err = run_cli(tmp_path, "bench", "--quick", "--groups", "pool,store",
                           hide=("xxhash",))
    assert rc == 0, err
    lines = [ln for ln in out.splitlines() if "skipped" in ln]
    assert len(lines) == 1, out
    assert "store group" in lines[0] and "pip install '.[store]'" in lines[0], lines
    assert "== pool" in out


def test_the_skipped_line_names_missing_redis_pieces(monkeypatch):
    from ferrox_kv.bench import runner
    from ferrox_kv.bench.groups import store
    assert runner.missing_line(["pool"]) is None
    monkeypatch.setattr(store, "try_import", lambda name: None if name == "redis" else object())
    line = runner.missing_line(["pool", "store"])
    assert "Redis rows" in line and "pip install '.[redis]'" in line
    monkeypatch.setattr(store, "try_import", lambda name: object())
    monkeypatch.setattr(store.shutil, "which", lambda name: None)
    assert "apt-get install redis-server" in runner.missing_line(["store"])


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path):
    # refused before any work: status 2, the hint on stderr, no group run
    png = tmp_path / "bench.png"
    rc, out, err = run_cli(tmp_path, "bench", "--quick", "--groups", "pool",
                           "--plot", str(png), hide=("matplotlib",))
    assert rc == 2, err
    hints = [ln for ln in err.splitlines() if "matplotlib" in ln]
    assert len(hints) == 1 and "pip install '.[plot]'" in hints[0], err
    assert out == "" and "[bench" not in err, (out, err)
    assert not png.exists()


def test_plot_writes_a_png_or_says_how(tmp_path):
    png = tmp_path / "bench.png"
    rc, out, err = run_cli(tmp_path, "bench", "--quick", "--groups", "push",
                           "--geometry", "small", "--plot", str(png))
    if importlib.util.find_spec("matplotlib") is not None:
        assert rc == 0, err
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert rc == 2 and "pip install '.[plot]'" in err and not png.exists()
