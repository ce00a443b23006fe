"""The tests' thread runner: the bench's (``ferrox_kv.bench.harness``), so
that a test and a timed run start their threads the same way."""
from ferrox_kv.bench.harness import start_together


def run_threads(n, work, timeout=120):
    """Run ``work(i)`` on ``n`` threads started together; returns what they
    raised (a list, empty when every one finished cleanly). A thread still
    running after ``timeout`` seconds fails the test."""
    return start_together(n, work, timeout)[1]
