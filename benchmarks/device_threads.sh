#!/usr/bin/env bash
# benchmarks/device_threads.sh [N] -- issue 23's thread rows on a many-core
# machine, from a source checkout, with nothing installed and no network.
#
#   OUT=/some/dir bash benchmarks/device_threads.sh 16
#
# Needs python3 with numpy, Cython, setuptools; torch for the SDPA baselines.
# It builds the extension in place, then runs the bench groups attention,
# precision, threads and hf (llama8b geometry), each at 1 and N threads
# (N: the first argument, default `nproc`), each on its own under a time
# limit (run_group below); the first three with transformers hidden, so
# that a transformers outside the hf extra's range cannot stop them, and
# hf with the machine's transformers, if it has one.  A group that fails
# or runs out of time is reported and does not stop the others.
# Writes to $OUT (default ./device_out): machine.txt, build.log, GROUP.json,
# GROUP.txt (the bench's report), GROUP.err, summary.txt (the issue's
# rows and targets, from the JSON), all.log.  Everything within $BUDGET
# seconds (default 400, build included), under 7 minutes with the summary.
set -u -o pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
N=${1:-$(nproc)}
OUT=${OUT:-$PWD/device_out}
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

# Each group runs on its own, with its own JSON, under a time limit: the
# smaller of its cap and what is left of $BUDGET seconds (from the start,
# build included), so that one slow group cannot take the others' rows.
BUDGET=${BUDGET:-400}
HIDE="$OUT/hide_transformers"
mkdir -p "$HIDE/transformers"
echo 'raise ImportError("hidden by device_threads.sh: the hf group runs apart")' > "$HIDE/transformers/__init__.py"
run_group() {  # name cap [env PYTHONPATH prefix]
    local name=$1 cap=$2 path=$3 left limit rc
    left=$(( BUDGET - ($(date +%s) - t0) ))
    limit=$(( cap < left ? cap : left ))
    if [ "$limit" -lt 20 ]; then
        echo "SKIPPED $name: $left s of the $BUDGET s budget left"
        return
    fi
    stamp "bench $name at 1 and $N threads, at most $limit s"
    PYTHONPATH="$path" timeout "$limit" "$PY" -m ferrox_kv bench --groups "$name" --geometry llama8b \
        --threads "$N" --json "$OUT/$name.json" > "$OUT/$name.txt" 2> "$OUT/$name.err"
    rc=$?
    tail -3 "$OUT/$name.err"
    [ $rc -eq 0 ] || echo "FAILED $name: exit $rc (124: over its $limit s; see $OUT/$name.err)"
}

# the core groups with transformers hidden (an import of it fails, and the
# bench skips its hf rows and says so): a transformers outside the hf
# extra's range cannot stop them
run_group attention "${CAP_ATTENTION:-150}" "$HIDE:$PYTHONPATH"
run_group precision "${CAP_PRECISION:-120}" "$HIDE:$PYTHONPATH"
run_group threads "${CAP_THREADS:-90}" "$HIDE:$PYTHONPATH"
# the hf group with the machine's transformers, if it has one
if "$PY" -c "import transformers" 2> /dev/null; then
    echo "transformers $("$PY" -c "import transformers; print(transformers.__version__)")" \
         "(the hf extra is tested with >=5.24,<5.25; with another, the hf group may fail: then" \
         "carry a transformers 5.24 wheel, unpack it and put it first on PYTHONPATH)"
    run_group hf "${CAP_HF:-120}" "$PYTHONPATH"
else
    echo "no transformers here: the hf group is skipped"
fi

stamp "summary"
"$PY" - "$OUT" "$N" <<'EOF' | tee "$OUT/summary.txt"
import json, os, sys
out, n = sys.argv[1], int(sys.argv[2])
rows, targets = [], []
for name in ("attention.json", "precision.json", "threads.json", "hf.json"):
    p = os.path.join(out, name)
    if os.path.exists(p):
        d = json.load(open(p))
        rows += d["results"]
        targets += d["targets"]
        print(f"{name}: {d['machine']['cpus']} cpus, simd {d['machine']['simd_path']}, "
              f"{d['elapsed_s']:.0f} s; skipped: {d['skipped']}")
keep = ("attention.", "precision.attend", "hf.", "threads.")
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
