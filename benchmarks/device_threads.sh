#!/usr/bin/env bash
# benchmarks/device_threads.sh [N] -- issue 23's thread rows on a many-core
# machine, from a source checkout, with nothing installed and no network.
#
#   OUT=/some/dir bash benchmarks/device_threads.sh 16
#
# Needs python3 with numpy, Cython, setuptools; torch for the SDPA baselines.
# It builds the extension in place, then runs, each at 1 and N threads
# (N: the first argument, default `nproc`):
#   1. the groups attention, precision and threads (llama8b geometry), with
#      transformers hidden, so that a transformers outside the tested range
#      (pyproject's hf extra) cannot stop them;
#   2. the hf group with the machine's transformers, if it has one, under
#      a time limit; a failure there is reported and does not fail the run.
# Writes to $OUT (default ./device_out): machine.txt, build.log, bench.json,
# bench.txt (the bench's report), hf.json and hf.txt (if run), summary.txt
# (the issue's target rows, from the JSON), all.log.  About 5 minutes on
# 16 cores (the build is 1-2 of them); the hf group is capped at
# $HF_LIMIT seconds (default 150).
set -u -o pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
N=${1:-$(nproc)}
OUT=${OUT:-$PWD/device_out}
HF_LIMIT=${HF_LIMIT:-150}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee "$OUT/all.log") 2>&1
t0=$(date +%s)
stamp() { echo "== $(( $(date +%s) - t0 )) s: $*"; }

stamp "machine"
{
    echo "date: $(date -u)"
    echo "nproc: $(nproc)"
    lscpu | grep -E '^(Model name|Socket|Core|Thread|NUMA node\(s\)|L3)' || true
    echo "flags: $(grep -m1 -o -E '\b(avx2|avx512f|avx512bw|avx512_vnni|avx_vnni|avx512_bf16|amx_tile)\b' /proc/cpuinfo | sort -u | tr '\n' ' ')"
    "$PY" - <<'EOF'
import platform
print("python", platform.python_version())
for m in ("numpy", "Cython", "torch", "transformers"):
    try:
        mod = __import__(m)
        print(m, mod.__version__, getattr(mod, "__file__", ""))
    except Exception as e:  # noqa: BLE001
        print(m, "not importable:", type(e).__name__, e)
EOF
} | tee "$OUT/machine.txt"

stamp "build: setup.py build_ext --inplace -j $N"
cd "$ROOT" || exit 1
if ! { time "$PY" setup.py build_ext --inplace -j "$N" > "$OUT/build.log" 2>&1; }; then
    tail -40 "$OUT/build.log"
    echo "BUILD FAILED (whole log: $OUT/build.log)"
    exit 1
fi

# python -m from outside the checkout (from its root, python -m refuses the
# source tree); the tree comes first on the path
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$OUT" || exit 1
"$PY" -m ferrox_kv info | tee -a "$OUT/machine.txt"

# 1. the core groups, transformers hidden (an import of it fails, and the
#    bench skips its hf rows and says so)
HIDE="$OUT/hide_transformers"
mkdir -p "$HIDE/transformers"
echo 'raise ImportError("hidden by device_threads.sh: the hf group runs apart")' > "$HIDE/transformers/__init__.py"
stamp "bench: attention, precision, threads at 1 and $N threads"
PYTHONPATH="$HIDE:$PYTHONPATH" "$PY" -m ferrox_kv bench --groups attention,precision,threads \
    --geometry llama8b --threads "$N" --json "$OUT/bench.json" > "$OUT/bench.txt" 2> "$OUT/bench.err"
rc=$?
tail -5 "$OUT/bench.err"
[ $rc -eq 0 ] || echo "bench exited $rc (see $OUT/bench.err)"

# 2. the hf group, if this machine's transformers works with ferrox_kv.hf
if "$PY" -c "import transformers" 2> /dev/null; then
    tv=$("$PY" -c "import transformers; print(transformers.__version__)")
    echo "transformers $tv (the hf extra is tested with >=5.24,<5.25; an older one may fail here)"
    stamp "bench: hf at 1 and $N threads, at most $HF_LIMIT s"
    timeout "$HF_LIMIT" "$PY" -m ferrox_kv bench --groups hf --threads "$N" \
        --json "$OUT/hf.json" > "$OUT/hf.txt" 2> "$OUT/hf.err"
    hrc=$?
    tail -5 "$OUT/hf.err"
    [ $hrc -eq 0 ] || echo "hf group exited $hrc (124: over $HF_LIMIT s); the other rows stand. To run it, carry a transformers 5.24 wheel and put it on PYTHONPATH."
else
    echo "no transformers here: the hf group is skipped"
fi

stamp "summary"
"$PY" - "$OUT" "$N" <<'EOF' | tee "$OUT/summary.txt"
import json, os, sys
out, n = sys.argv[1], int(sys.argv[2])
rows, targets = [], []
for name in ("bench.json", "hf.json"):
    p = os.path.join(out, name)
    if os.path.exists(p):
        d = json.load(open(p))
        rows += d["results"]
        targets += d["targets"]
        print(f"{name}: {d['machine']['cpus']} cpus, simd {d['machine']['simd_path']}, "
              f"{d['elapsed_s']:.0f} s; skipped: {d['skipped']}")
keep = ("attention.", "precision.attend", "hf.")
print(f"\n{'row':72} {'threads':>7} {'value':>10} {'unit':9} {'ratio':>7}  of")
for r in rows:
    if r["slug"].startswith(keep) and r.get("threads") in (1, n):
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(f"{r['name'][:72]:72} {r.get('threads', ''):>7} {r['value']:10.4g} {r['unit']:9} {ratio:>7}  "
              f"{r['ratio_of'] or ''}")
print("\ntargets")
for t in targets:
    met = "met" if t["met"] else ("info" if t["met"] is None else "MISSED")
    val = "n/a" if t["value"] is None else f"{t['value']:.3f}"
    print(f"  {t['target'][:70]:70} {val:>8} {t['goal']:>8} {met}  {json.dumps(t['where'])}")
EOF
stamp "done: $OUT"
