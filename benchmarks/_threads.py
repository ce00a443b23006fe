"""Shared by the scripts in benchmarks/: run one round of work per thread, over
and over, for a fixed time (threads started by the bench's runner)."""
import time

from ferrox_kv.bench.harness import run_threads


def rounds_per_second(nthreads, one_round, seconds):
    """Start ``nthreads`` threads that call ``one_round(i)`` for ``seconds``
    from their common start; return the rounds completed by all of them per
    second."""
    rounds = [0] * nthreads

    def work(i):
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop:
            one_round(i)
            rounds[i] += 1

    return sum(rounds) / run_threads(nthreads, work)
