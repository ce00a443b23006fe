"""The precision group of ``ferrox-kv bench`` (``ferrox_kv/bench/groups/precision.py``):
what each storage dtype costs and buys, ratios taken in one run.

    python benchmarks/precision.py [--quick] [--json out.json]

is ``ferrox-kv bench --groups precision`` with the same options.
"""
import sys

from ferrox_kv.bench import main

if __name__ == "__main__":
    sys.exit(main(["--groups", "precision", *sys.argv[1:]], prog="benchmarks/precision.py"))
