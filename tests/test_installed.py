"""The suite runs against the installed package, and a source tree without
its compiled core says what to do instead of failing on a missing _core."""
import os
import shutil
import subprocess
import sys

import ferrox_kv

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_suite_imports_the_installed_package_not_the_source_tree():
    here = os.path.dirname(os.path.abspath(ferrox_kv.__file__))
    if os.environ.get("FERROX_KV_ALLOW_SOURCE") != "1":       # an in-place development build
        assert here != os.path.join(CHECKOUT, "ferrox_kv"), here
        assert "site-packages" in here or "dist-packages" in here, here


def test_importing_a_source_tree_without_its_core_says_what_to_do(tmp_path):
    src = os.path.join(os.path.dirname(os.path.abspath(ferrox_kv.__file__)), "__init__.py")
    os.makedirs(tmp_path / "ferrox_kv")
    shutil.copy(src, tmp_path / "ferrox_kv" / "__init__.py")
    out = subprocess.run([sys.executable, "-m", "ferrox_kv", "info"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "ImportError" in out.stderr and "source tree" in out.stderr
    assert "ferrox-kv" in out.stderr and "build_ext --inplace" in out.stderr


def test_signatures_are_introspectable_and_help_shows_them():
    import inspect
    import pydoc
    from ferrox_kv import KvBlockPool, KvCache
    assert str(inspect.signature(KvCache)) == "(n_kv_heads, head_dim, *, v_head_dim=None, dtype='float32')"
    assert str(inspect.signature(KvBlockPool)) == (
        "(block_size, total_blocks, n_kv_heads, head_dim, *, v_head_dim=None, "
        "prefix_cache=False, dtype='float32')")
    assert "(n_kv_heads, head_dim, pool, max_seq_len, *, v_head_dim=None, tokens=None, " \
           "salt=None, dtype=None)" in str(inspect.signature(KvCache.with_pool))
    text = pydoc.render_doc(KvCache, renderer=pydoc.plaintext)
    assert "KvCache(n_kv_heads, head_dim, *, v_head_dim=None, dtype='float32')" in text


def test_importing_the_hf_module_without_torch_names_the_install_command():
    code = ("import sys\nsys.modules['torch'] = None\n"
            "try:\n    import ferrox_kv.hf\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=os.path.dirname(CHECKOUT))
    assert "pip install '.[hf]'" in out.stdout, out.stdout + out.stderr
