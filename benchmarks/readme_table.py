"""Print a bench run's targets and rows as markdown tables, from a
`ferrox-kv bench --json PATH` file.

    python benchmarks/readme_table.py bench.json
"""
import json
import sys

from ferrox_kv.bench import fmt_quantity


def main(path):
    doc = json.load(open(path))
    if doc.get("verdict"):          # schema 2 on
        print(doc["verdict"] + "\n")
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
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(f"| {r['group']} | {r['geometry']} | {r['name']} | "
              f"{fmt_quantity(r['value'], r['unit'])} | {ratio} | "
              f"{r['ratio_of'] or ''} |")
    m = doc["machine"]
    print(f"\n({m['cpus']} CPUs, {m['platform']}, Python {m['python']}, numpy {m['numpy']}; "
          f"ran {doc['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main(sys.argv[1])
