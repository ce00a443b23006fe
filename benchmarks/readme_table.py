"""Print the README's performance table from a `python -m ferrox_kv.bench
--json PATH` file: the targets first, then a few headline figures.

    python benchmarks/readme_table.py bench.json
"""
import json
import sys


def main(path):
    doc = json.load(open(path))
    print("| target (this run) | measured | goal | |")
    print("| --- | --- | --- | --- |")
    for t in doc["targets"]:
        verdict = "met" if t["met"] else ("" if not t["goal"] else "**missed**")
        print(f"| {t['target'].strip()} | {t['value']:.3f} | {t['goal']} | {verdict} |")
    print()
    print("| group | geometry | measure | value | ratio | of |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in doc["results"]:
        if r["group"] in ("threads",) and r.get("threads") not in (1, 2):
            continue
        v = r["value"]
        sv = f"{v:.4g}" if isinstance(v, float) else str(v)
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(f"| {r['group']} | {r['geometry']} | {r['name']} | {sv} {r['unit']} | {ratio} | "
              f"{r['ratio_of'] or ''} |")
    m = doc["machine"]
    print(f"\n({m['cpus']} CPUs, {m['platform']}, Python {m['python']}, numpy {m['numpy']}; "
          f"ran {doc['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main(sys.argv[1])
