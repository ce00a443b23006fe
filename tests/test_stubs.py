"""The type stubs (_core.pyi) match the compiled module (mypy's stubtest)."""
import os
import subprocess
import tempfile
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(os.environ.get("FERROX_KV_ASAN") == "1",
                    reason="mypy's compiled modules are not run under AddressSanitizer; "
                           "the normal CI pass runs this test")
def test_stubs_match_the_compiled_module():
    pytest.importorskip("mypy")
    out = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "ferrox_kv._core",
         "--allowlist", os.path.join(HERE, "stubtest_allowlist.txt")],
        capture_output=True, text=True, cwd=tempfile.gettempdir())  # not the source tree
    assert out.returncode == 0, out.stdout + out.stderr
