"""Shared by the scripts in benchmarks/: run one round of work per thread, over
and over, for a fixed time."""
import threading
import time


def rounds_per_second(nthreads, one_round, seconds):
    """Start ``nthreads`` threads that call ``one_round(i)`` until ``seconds``
    have passed; return the rounds completed by all of them per second."""
    rounds = [0] * nthreads
    stop = time.perf_counter() + seconds
    barrier = threading.Barrier(nthreads)

    def work(i):
        barrier.wait()
        while time.perf_counter() < stop:
            one_round(i)
            rounds[i] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(nthreads)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(rounds) / (time.perf_counter() - t0)
