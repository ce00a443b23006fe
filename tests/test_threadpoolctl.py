"""threadpoolctl sees ferrox_kv's worker pool: threadpool_info() lists it
with its thread count, threadpool_limits(n) limits it and restores it, in
either import order, and importing ferrox_kv does not import threadpoolctl."""
import os
import subprocess
import sys

import pytest

import ferrox_kv

threadpoolctl = pytest.importorskip("threadpoolctl")
if not hasattr(threadpoolctl, "register"):  # pragma: no cover
    pytest.skip("threadpoolctl < 3.5 has no register()", allow_module_level=True)


def _ours(info):
    return [i for i in info if i["internal_api"] == "ferrox_kv"]


def test_threadpool_info_lists_the_pool_with_its_count():
    old = ferrox_kv.set_num_threads(3)
    try:
        (entry,) = _ours(threadpoolctl.threadpool_info())
        assert entry["user_api"] == "ferrox_kv"
        assert entry["num_threads"] == 3
        assert entry["version"] == ferrox_kv.__version__
        assert os.path.realpath(entry["filepath"]) == os.path.realpath(ferrox_kv._core.__file__)
    finally:
        ferrox_kv.set_num_threads(old)


@pytest.mark.parametrize("user_api", [None, "ferrox_kv"])
def test_threadpool_limits_sets_the_count_and_restores_it(user_api):
    old = ferrox_kv.set_num_threads(5)
    try:
        with threadpoolctl.threadpool_limits(1, user_api=user_api):
            assert ferrox_kv.get_num_threads() == 1
            (entry,) = _ours(threadpoolctl.threadpool_info())
            assert entry["num_threads"] == 1
        assert ferrox_kv.get_num_threads() == 5
        limiter = threadpoolctl.threadpool_limits({"ferrox_kv": 2})
        assert ferrox_kv.get_num_threads() == 2
        limiter.restore_original_limits()
        assert ferrox_kv.get_num_threads() == 5
    finally:
        ferrox_kv.set_num_threads(old)


def test_a_limit_of_blas_alone_leaves_the_pool_alone():
    old = ferrox_kv.set_num_threads(4)
    try:
        with threadpoolctl.threadpool_limits(1, user_api="blas"):
            assert ferrox_kv.get_num_threads() == 4
    finally:
        ferrox_kv.set_num_threads(old)


_ORDERS = {
    "ferrox_kv first": ("import ferrox_kv, sys; lazy = 'threadpoolctl' not in sys.modules; "
                        "import threadpoolctl"),
    "threadpoolctl first": "import sys, threadpoolctl, ferrox_kv; lazy = True",
}


@pytest.mark.parametrize("order", sorted(_ORDERS))
def test_either_import_order_registers_once_and_ferrox_kv_never_imports_it(order):
    code = _ORDERS[order] + (
        "\nentries = [i for i in threadpoolctl.threadpool_info() if i['internal_api'] == 'ferrox_kv']"
        "\nwith threadpoolctl.threadpool_limits(1):\n    inside = ferrox_kv.get_num_threads()"
        "\nprint(lazy, len(entries), entries[0]['num_threads'], inside, ferrox_kv.get_num_threads(),"
        " sum(type(f).__name__ == '_Finder' for f in sys.meta_path))")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         timeout=120, cwd="/", env={**os.environ, "FERROX_KV_NUM_THREADS": "3"})
    assert out.returncode == 0, out.stderr
    # lazy: ferrox_kv did not import threadpoolctl; one entry of 3 threads,
    # 1 inside the limit, 3 after it; the import finder removed itself
    assert out.stdout.split() == ["True", "1", "3", "1", "3", "0"]


def test_another_packages_core_library_is_neither_claimed_nor_an_error(tmp_path):
    # another extension named _core.<tag>.so, loaded in the same process:
    # threadpoolctl lists ferrox_kv's core once, and the controller's
    # constructor (which threadpoolctl before 3.8 does not guard) accepts
    # the other library without raising
    import ctypes
    import subprocess as sp
    import sysconfig

    src = tmp_path / "other.c"
    src.write_text("int other_core_function(void) { return 7; }\n")
    lib = tmp_path / ("_core" + sysconfig.get_config_var("EXT_SUFFIX"))
    sp.run(["gcc", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    handle = ctypes.CDLL(str(lib))
    assert handle.other_core_function() == 7
    entries = _ours(threadpoolctl.threadpool_info())
    assert [os.path.realpath(e["filepath"]) for e in entries] == [
        os.path.realpath(ferrox_kv._core.__file__)]
    (cls,) = [c for c in threadpoolctl._ALL_CONTROLLERS if c.internal_api == "ferrox_kv"]
    other = cls(filepath=str(lib), prefix="_core.", parent=None)
    assert other.version is None
    assert not hasattr(other.dynlib, cls.check_symbols[0])
