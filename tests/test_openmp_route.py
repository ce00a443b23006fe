"""Split calls on torch's OpenMP team, the route ferrox_kv.hf takes
(``attend_on_torch_threads``): the same bits as on the worker pool, the
team's threads instead of new ones, the route scoped to one call, and off in
a fork child."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import ferrox_kv  # noqa: E402
from ferrox_kv import KvBlockPool, KvCache, attend_many  # noqa: E402
from ferrox_kv import _core  # noqa: E402
from ferrox_kv.hf.attention import _torch_openmp, attend_on_torch_threads  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.backends.openmp.is_available(),
                                reason="this torch has no OpenMP runtime to route to")


@pytest.fixture
def threads():
    """Sets ferrox_kv's and torch's thread counts together, forces the split
    on every call, and restores all three after the test."""
    old = (ferrox_kv.get_num_threads(), torch.get_num_threads(), _core._set_attend_split(0, 1))

    def both(n):
        ferrox_kv.set_num_threads(n)
        torch.set_num_threads(n)

    yield both
    ferrox_kv.set_num_threads(old[0])
    torch.set_num_threads(old[1])
    _core._set_attend_split(*old[2])


def _pooled(t, dtype="float32", seed=0, h=4, d=64, block=16):
    rng = np.random.default_rng(seed)
    c = KvCache.with_pool(h, d, KvBlockPool(block, -(-t // block) + 1, h, d, dtype=dtype), t)
    c.extend(rng.standard_normal((t, h, d), dtype=np.float32),
             rng.standard_normal((t, h, d), dtype=np.float32))
    return c


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def _pool_threads_gone():
    ferrox_kv.set_num_threads(1)
    for _ in range(500):
        if _core._worker_threads_alive() == 0:
            return
        time.sleep(0.01)
    raise AssertionError("the pool threads did not end")


def test_torchs_runtime_is_found_and_is_gnu_openmp():
    path = _torch_openmp()
    assert path is not None and os.path.basename(path).startswith("libgomp") and os.path.exists(path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("n", [2, 3])
def test_the_route_gives_the_pools_bits_on_n_team_threads(threads, n, dtype):
    threads(n)
    caches = [_pooled(t, dtype, seed=t) for t in (37, 200, 2)]
    q = np.random.default_rng(1).standard_normal((3, 2, 8, 64), dtype=np.float32)
    q1 = q[0, 0]
    q1[0, 5] = np.nan                                   # NaN reaches the output as on the pool
    want_many, want_one = attend_many(caches, q), caches[1].attend(q1)
    assert _core._openmp_route(_torch_openmp())
    try:
        got_many = attend_many(caches, q)
        used_many = _core._attend_threads_used()
        got_one = caches[1].attend(q1)
        used_one = _core._attend_threads_used()
    finally:
        assert not _core._openmp_route(None)
    assert used_many == used_one == n
    assert np.array_equal(_bits(got_many), _bits(want_many))
    assert np.array_equal(_bits(got_one), _bits(want_one))
    assert np.isnan(got_one[0]).all() and not np.isnan(got_one[1:]).any()


def test_a_library_without_the_entry_points_or_not_loaded_leaves_the_pool(threads, tmp_path):
    threads(2)
    c = _pooled(100)
    q = np.ones((8, 64), np.float32)
    want = c.attend(q)
    assert not _core._openmp_route(str(tmp_path / "libgomp.so.1"))   # no such file
    assert not _core._openmp_route(_core.__file__)                   # loaded, no GOMP_parallel
    assert np.array_equal(_bits(c.attend(q)), _bits(want))
    assert _core._attend_threads_used() == 2 and _core._worker_threads_alive() == 1


def test_routed_calls_start_no_pool_thread_and_the_route_ends_with_the_call(threads):
    threads(2)
    _pool_threads_gone()
    threads(2)
    c = _pooled(300)
    q = np.random.default_rng(2).standard_normal((1, 1, 8, 64), dtype=np.float32)
    want = attend_many([c], q, threads=1)
    for _ in range(5):
        got = attend_on_torch_threads([c], q)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert _core._attend_threads_used() == 2
    assert _core._worker_threads_alive() == 0            # the team's threads ran the parts
    c.attend(q[0, 0])                                    # not routed: the pool
    assert _core._worker_threads_alive() == 1


def test_torch_set_num_threads_bounds_the_routed_call(threads):
    threads(3)
    torch.set_num_threads(2)
    c = _pooled(300)
    attend_on_torch_threads([c], np.ones((1, 1, 8, 64), np.float32))
    assert _core._attend_threads_used() == 2


def test_a_fork_child_takes_the_pool_and_the_parent_keeps_the_route(threads):
    threads(2)
    c = _pooled(500)
    q = np.random.default_rng(3).standard_normal((8, 64), dtype=np.float32)
    want = c.attend(q)
    path = _torch_openmp()
    assert _core._openmp_route(path)
    try:
        c.attend(q)                                      # the team exists and has run
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                refused = not _core._openmp_route(path)
                got = c.attend(q)
                ok = (np.array_equal(_bits(got), _bits(want)) and _core._attend_threads_used() == 2
                      and _core._worker_threads_alive() == 1)
                code = 0 if refused and ok else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        assert np.array_equal(_bits(c.attend(q)), _bits(want))
        assert _core._openmp_route(path)
    finally:
        _core._openmp_route(None)


def test_ferrox_kv_torch_openmp_0_keeps_the_pool():
    code = ("import os, torch; from ferrox_kv.hf.attention import _torch_openmp; "
            "print(_torch_openmp())")
    env = dict(os.environ, FERROX_KV_TORCH_OPENMP="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"
