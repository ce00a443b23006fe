"""Split calls on torch's OpenMP team, the route ferrox_kv.hf takes
(``_attend_on_torch_threads``) and the core takes for the main thread once
torch is imported: the units spread over the team's threads with distinct
slots, the same bits as on the worker pool, no pool thread started, the
route scoped to one call, other threads on the pool, only torch's runtime
taken, and off in a fork child."""
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import ferrox_kv  # noqa: E402
from ferrox_kv import KvBlockPool, KvCache, attend_many  # noqa: E402
from ferrox_kv import _core  # noqa: E402
from ferrox_kv.hf.attention import _attend_on_torch_threads, _torch_openmp  # noqa: E402

pytestmark = pytest.mark.skipif(_torch_openmp() is None,
                                reason="no GNU OpenMP runtime behind this torch to route to")


@pytest.fixture
def threads():
    """Sets ferrox_kv's and torch's thread counts together, forces the split
    on every call, and restores all three (and the route: off) after."""
    old = (ferrox_kv.get_num_threads(), torch.get_num_threads(), _core._set_attend_split(0, 1))

    def both(n):
        ferrox_kv.set_num_threads(n)
        torch.set_num_threads(n)

    yield both
    _core._openmp_route(False)
    ferrox_kv.set_num_threads(old[0])
    torch.set_num_threads(old[1])
    _core._set_attend_split(*old[2])


def _pooled(t, dtype="float32", seed=0, h=4, d=64, block=16):
    rng = np.random.default_rng(seed)
    c = KvCache.with_pool(h, d, KvBlockPool(block, -(-t // block) + 1, h, d, dtype=dtype), t)
    c.extend(rng.standard_normal((t, h, d), dtype=np.float32),
             rng.standard_normal((t, h, d), dtype=np.float32))
    return c


@pytest.fixture
def main_routes():
    """The main thread's split calls take torch's team, as outside the
    tests (conftest.py turns that off for every other test)."""
    old = _core._set_route_main(True)
    yield
    _core._set_route_main(old)


def _on_another_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(60)
    assert out, "the call on another thread did not finish"
    return out[0]


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def _no_pool_threads(n):
    """Ends every pool thread (the count lowered to 1, then set to n)."""
    ferrox_kv.set_num_threads(1)
    for _ in range(1000):
        if _core._worker_threads_alive() == 0:
            break
        time.sleep(0.01)
    assert _core._worker_threads_alive() == 0
    ferrox_kv.set_num_threads(n)


def _wait(pid, seconds=60):
    """The child's exit status; a child still running after ``seconds`` is
    killed and the test fails."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError(f"the child did not finish within {seconds} s")


def test_the_runtime_is_torchs_reached_through_libtorch_cpu():
    path = _torch_openmp()
    assert os.path.basename(path).startswith("libtorch_cpu")
    assert path.startswith(os.path.dirname(torch.__file__) + os.sep)


@pytest.mark.parametrize("n", [2, 3])
def test_routed_units_spread_over_n_team_threads_with_distinct_slots(threads, n):
    threads(n)
    _no_pool_threads(n)
    for _ in range(5):      # the caller sleeps in its units; a busy machine may still stall the team
        joined, slots, tids, caller, on = _core._workers_probe(64, n, True)
        assert on and joined == n
        assert set(slots) <= set(range(n))
        by_thread = {}
        for s, t in zip(slots, tids):
            by_thread.setdefault(t, set()).add(s)
        assert all(len(s) == 1 for s in by_thread.values())       # one slot per thread
        assert len({next(iter(s)) for s in by_thread.values()}) == len(by_thread)   # distinct
        assert by_thread.get(caller, {0}) == {0}                   # the caller is slot 0
        if set(by_thread) - {caller}:
            break
    assert set(by_thread) - {caller}                               # a team thread ran units
    assert _core._worker_threads_alive() == 0                   # the pool stayed empty
    joined, slots, tids, caller, on = _core._workers_probe(64, n, False)
    assert not on and _core._worker_threads_alive() == n - 1   # off again: the pool


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("n", [2, 3])
def test_the_route_gives_the_pools_bits(threads, n, dtype):
    threads(n)
    caches = [_pooled(t, dtype, seed=t) for t in (37, 200, 2)]
    q = np.random.default_rng(1).standard_normal((3, 2, 8, 64), dtype=np.float32)
    q1 = q[0, 0]
    q1[0, 5] = np.nan                                   # NaN reaches the output as on the pool
    want_many, want_one = attend_many(caches, q), caches[1].attend(q1)
    assert _core._openmp_route(True)
    try:
        got_many = attend_many(caches, q)
        got_one = caches[1].attend(q1)
    finally:
        assert not _core._openmp_route(False)
    assert np.array_equal(_bits(got_many), _bits(want_many))
    assert np.array_equal(_bits(got_one), _bits(want_one))
    assert np.isnan(got_one[0]).all() and not np.isnan(got_one[1:]).any()


def test_only_a_library_that_reaches_the_taken_runtime_is_accepted(tmp_path):
    assert _core._openmp_load(_torch_openmp())                        # taken already: the same
    assert not _core._openmp_load(str(tmp_path / "libgomp.so.1"))     # not loaded
    assert not _core._openmp_load(_core.__file__)                     # loaded, no runtime behind
    with pytest.raises(ValueError, match="NUL"):
        _core._openmp_load("libgomp\0.so")


def test_the_helper_routes_its_call_alone_and_starts_no_pool_thread(threads):
    threads(2)
    _no_pool_threads(2)
    c = _pooled(300)
    q = np.random.default_rng(2).standard_normal((1, 1, 8, 64), dtype=np.float32)
    want = attend_many([c], q, threads=1)
    for _ in range(5):
        got = _attend_on_torch_threads([c], q)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert _core._attend_threads_used() == 2
    assert _core._worker_threads_alive() == 0            # the team's threads ran the parts
    c.attend(q[0, 0])                                    # not routed: the pool
    assert _core._worker_threads_alive() == 1


def test_the_route_is_off_after_a_call_that_raises(threads):
    threads(2)
    c = _pooled(50)
    with pytest.raises(ValueError, match="q must be shaped"):
        _attend_on_torch_threads([c], np.ones((8, 64), np.float32))
    _no_pool_threads(2)
    c.attend(np.ones((8, 64), np.float32))
    assert _core._worker_threads_alive() == 1            # the pool ran it: the route was off


def test_torch_set_num_threads_bounds_the_routed_call(threads):
    threads(3)
    torch.set_num_threads(2)
    _no_pool_threads(3)
    c = _pooled(300)
    _attend_on_torch_threads([c], np.ones((1, 1, 8, 64), np.float32))
    assert _core._attend_threads_used() == 2 and _core._worker_threads_alive() == 0


def test_a_fork_child_takes_the_pool_and_the_parent_keeps_the_route(threads):
    threads(2)
    c = _pooled(500)
    q = np.random.default_rng(3).standard_normal((8, 64), dtype=np.float32)
    want = c.attend(q)
    assert _core._openmp_route(True)
    c.attend(q)                                          # the team exists and has run
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            refused = not _core._openmp_route(True) and not _core._openmp_load(_torch_openmp())
            got = c.attend(q)
            ok = (np.array_equal(_bits(got), _bits(want)) and _core._attend_threads_used() == 2
                  and _core._worker_threads_alive() == 1)
            code = 0 if refused and ok else 3
        finally:
            os._exit(code)
    status = _wait(pid)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert np.array_equal(_bits(c.attend(q)), _bits(want))
    assert _core._openmp_route(True)


def test_a_child_forked_before_any_split_refuses_the_route(tmp_path):
    """The fork handlers are registered at import: a parent whose torch ran
    OpenMP but whose ferrox_kv never split a call still makes children
    that refuse the route (the team they would wait for is the parent's)."""
    code = (
        "import os, sys, torch\n"
        "torch.set_num_threads(2)\n"
        "from ferrox_kv import _core\n"
        "from ferrox_kv.hf.attention import _torch_openmp\n"
        "torch.ones(4096, 4096).sum()\n"
        "path = _torch_openmp()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if not _core._openmp_route(True) and not _core._openmp_load(path) else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print('child', os.waitstatus_to_exitcode(status), 'parent', _core._openmp_route(True))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "child 0 parent True" in out.stdout, out.stdout


def test_ferrox_kv_torch_openmp_0_keeps_the_pool(tmp_path):
    code = "import torch; from ferrox_kv.hf.attention import _torch_openmp; print(_torch_openmp())"
    env = dict(os.environ, FERROX_KV_TORCH_OPENMP="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_main_threads_split_calls_take_torchs_team_with_the_pools_bits(threads, main_routes, dtype):
    threads(2)
    _no_pool_threads(2)
    caches = [_pooled(t, dtype, seed=t) for t in (300, 41)]
    q = np.random.default_rng(4).standard_normal((2, 1, 8, 64), dtype=np.float32)
    got_one, got_many = caches[0].attend(q[0, 0]), attend_many(caches, q)
    assert _core._attend_threads_used() == 2
    assert _core._worker_threads_alive() == 0            # torch's team ran the parts
    assert not _core._openmp_routed()                    # this call's alone
    want_one = _on_another_thread(lambda: caches[0].attend(q[0, 0]))
    assert _core._worker_threads_alive() == 1            # another thread: the pool
    want_many = _on_another_thread(lambda: attend_many(caches, q))
    assert np.array_equal(_bits(got_one), _bits(want_one))
    assert np.array_equal(_bits(got_many), _bits(want_many))


def test_the_read_floor_splits_where_attention_does(threads, main_routes):
    threads(2)
    _no_pool_threads(2)
    c = _pooled(300)
    _core._read_floor([c], 1, 2)
    assert _core._worker_threads_alive() == 0 and not _core._openmp_routed()
    _on_another_thread(lambda: _core._read_floor([c], 1, 2))
    assert _core._worker_threads_alive() == 1


def test_a_main_thread_call_that_raises_leaves_the_route_off(threads, main_routes):
    threads(2)
    c = _pooled(300)
    with pytest.raises(ValueError, match="not a multiple of the cache's n_kv_heads"):
        c.attend(np.ones((3, 64), np.float32))
    with pytest.raises(ValueError, match="q must be shaped"):
        _attend_on_torch_threads([c], np.ones((8, 64), np.float32))
    assert not _core._openmp_routed()
    c.attend(np.ones((8, 64), np.float32))
    assert not _core._openmp_routed()


def test_the_helper_on_the_main_thread_leaves_the_route_off_after(threads, main_routes):
    threads(2)
    _no_pool_threads(2)
    c = _pooled(300)
    _attend_on_torch_threads([c], np.ones((1, 1, 8, 64), np.float32))
    assert _core._attend_threads_used() == 2 and _core._worker_threads_alive() == 0
    assert not _core._openmp_routed()


def test_a_main_thread_call_wider_than_torchs_team_takes_the_pool(threads, main_routes):
    threads(3)
    torch.set_num_threads(2)
    _no_pool_threads(3)
    c = _pooled(300)
    c.attend(np.ones((8, 64), np.float32))
    assert _core._attend_threads_used() == 3 and _core._worker_threads_alive() == 2
    _no_pool_threads(3)
    c.attend(np.ones((8, 64), np.float32), threads=2)   # within torch's 2: the team
    assert _core._attend_threads_used() == 2 and _core._worker_threads_alive() == 0


def test_one_thread_never_routes(threads, main_routes):
    threads(1)
    c = _pooled(300)
    c.attend(np.ones((8, 64), np.float32))
    assert _core._attend_threads_used() == 1 and not _core._openmp_routed()


@pytest.mark.parametrize("env, pool_threads", [(None, 0), ("0", 1)])
def test_a_program_that_imports_torch_splits_on_its_team_unless_told_not_to(tmp_path, env, pool_threads):
    """A whole program, no test hook: with torch imported, the main
    thread's split ``attend`` runs on torch's team and starts no pool
    thread; ``FERROX_KV_TORCH_OPENMP=0`` keeps the pool."""
    code = (
        "import numpy as np, torch, ferrox_kv\n"
        "from ferrox_kv import KvCache, _core\n"
        "torch.set_num_threads(2); ferrox_kv.set_num_threads(2)\n"
        "c = KvCache.with_capacity(8, 128, 2048)\n"
        "rng = np.random.default_rng(0)\n"
        "c.extend(rng.standard_normal((2048, 8, 128), dtype=np.float32),\n"
        "         rng.standard_normal((2048, 8, 128), dtype=np.float32))\n"
        "torch.ones(1 << 20).sum()\n"
        "out = c.attend(rng.standard_normal((32, 128), dtype=np.float32))\n"
        "assert np.isfinite(out).all()\n"
        "print(_core._attend_threads_used(), _core._worker_threads_alive())\n")
    environ = dict(os.environ)
    environ.pop("FERROX_KV_TORCH_OPENMP", None)
    if env is not None:
        environ["FERROX_KV_TORCH_OPENMP"] = env
    out = subprocess.run([sys.executable, "-c", code], env=environ, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    used, alive = out.stdout.split()
    assert (int(used), int(alive)) == (2, pool_threads), out.stdout


@pytest.mark.parametrize("stub", ["removed", "none", "no_get_num_threads", "not_a_module"])
def test_an_odd_torch_module_never_breaks_a_main_thread_call(threads, main_routes, monkeypatch, stub):
    """Whatever sys.modules["torch"] holds (gone, None, a module without
    get_num_threads, not a module), a main-thread call attends, on the pool
    where the team cannot be asked, and leaves the route off."""
    threads(2)
    c = _pooled(300)
    q = np.random.default_rng(5).standard_normal((8, 64), dtype=np.float32)
    want = _on_another_thread(lambda: c.attend(q))
    if stub == "removed":
        monkeypatch.delitem(sys.modules, "torch")
    elif stub == "none":
        monkeypatch.setitem(sys.modules, "torch", None)
    elif stub == "no_get_num_threads":
        monkeypatch.delattr(torch, "get_num_threads")
    else:
        monkeypatch.setitem(sys.modules, "torch", object())
    got = c.attend(q)
    assert np.array_equal(_bits(got), _bits(want))
    assert not _core._openmp_routed()


def test_the_main_thread_and_request_threads_attend_together(threads, main_routes):
    """The main thread on torch's team while 4 request threads share the
    pool: every result is the one-call result, and the pool stays within
    its bound."""
    threads(2)
    _no_pool_threads(2)
    caches = [_pooled(300) for _ in range(5)]           # one per thread, the same rows
    c = caches[0]
    q = np.random.default_rng(6).standard_normal((8, 64), dtype=np.float32)
    want = _on_another_thread(lambda: c.attend(q))
    bad = []

    def request(own):
        for _ in range(20):
            if not np.array_equal(_bits(own.attend(q)), _bits(want)):
                bad.append(1)

    ts = [threading.Thread(target=request, args=(own,)) for own in caches[1:]]
    for t in ts:
        t.start()
    for _ in range(20):
        assert np.array_equal(_bits(c.attend(q)), _bits(want))
    for t in ts:
        t.join(120)
    assert not bad and not any(t.is_alive() for t in ts)
    assert _core._worker_threads_alive() <= ferrox_kv.get_num_threads() - 1
    assert not _core._openmp_routed()


def test_a_fork_child_of_a_routing_main_thread_attends_on_the_pool(threads, main_routes):
    threads(2)
    _no_pool_threads(2)
    c = _pooled(500)
    q = np.random.default_rng(7).standard_normal((8, 64), dtype=np.float32)
    want = c.attend(q)                                   # the main thread: torch's team
    assert _core._worker_threads_alive() == 0
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            got = c.attend(q)
            ok = (np.array_equal(_bits(got), _bits(want)) and _core._attend_threads_used() == 2
                  and _core._worker_threads_alive() == 1 and not _core._openmp_routed())
            code = 0 if ok else 3
        finally:
            os._exit(code)
    status = _wait(pid)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert np.array_equal(_bits(c.attend(q)), _bits(want))
    assert _core._worker_threads_alive() == 0            # the parent still routes
