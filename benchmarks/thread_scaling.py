"""Thread scaling on a many-core machine: 1, 2, 4, ... N threads, each with its
own caches on one shared pool (push, extend, push_layers, and the C copy floor
for the hardware's own scaling). A thin wrapper over the bench's threads group,
which logs each timed run to stderr and warns when the threads exceed the CPUs
this process may use (the extra threads then only time-slice).

    python benchmarks/thread_scaling.py --threads 16 --json scaling.json
"""
import argparse
import os
import sys

from ferrox_kv.bench import main

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--geometry", action="append", help="only this geometry (repeatable)")
    args = ap.parse_args()
    argv = ["--groups", "threads", "--threads", str(args.threads)]
    for geo in args.geometry or []:
        argv += ["--geometry", geo]
    if args.json:
        argv += ["--json", args.json]
    if args.quick:
        argv.append("--quick")
    sys.exit(main(argv))
