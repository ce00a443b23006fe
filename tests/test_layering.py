"""The library's layering (DESIGN.md): the core at the bottom, the store
above it. ``ferrox_kv._core`` imports no other ferrox_kv module, in its
sources or at run time; the store does not import the core at module level
(it is handed pools and caches); the core holds no import of the store
anywhere, not even a lazy one (an attached store is an object whose methods
the core calls, and the file forwards are connected by the package)."""
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORE_SOURCES = sorted([REPO / "ferrox_kv" / "_core.pyx", REPO / "ferrox_kv" / "_core.pxd"]
                      + list((REPO / "ferrox_kv").glob("*.pxi")))
STORE_MODULES = sorted((REPO / "ferrox_kv" / "store").glob("*.py"))

# an import statement of a ferrox_kv module, absolute or relative, anywhere in
# a line (a lazy import inside a function counts); prose in docstrings and
# comments that names ferrox_kv.store does not
IMPORT = re.compile(r"^\s*(?:from\s+(?:ferrox_kv\b|\.)\S*\s+(?:c?import)\b|c?import\s+ferrox_kv\b)",
                    re.M)


def _core_imports():
    found = []
    for path in CORE_SOURCES:
        for m in IMPORT.finditer(path.read_text()):
            line = path.read_text().count("\n", 0, m.start()) + 1
            found.append(f"{path.name}:{line}: {m.group(0).strip()}")
    return found


def test_the_core_sources_import_no_ferrox_kv_module():
    assert len(CORE_SOURCES) >= 8, CORE_SOURCES
    assert _core_imports() == []


def test_the_core_holds_no_import_of_the_store():
    for path in CORE_SOURCES:
        for line in path.read_text().splitlines():
            code = line.split("#", 1)[0]
            assert not re.search(r"\b(?:import|from)\s+(?:ferrox_kv\.store|\.store)\b", code), (
                f"{path.name}: {line.strip()}")


def test_the_pattern_finds_what_it_looks_for():
    # the check above would see each of these (main's tree had the first three)
    for line in ("        from ferrox_kv.store._pool import write_through",
                 "    from ferrox_kv.store._cache import load_cache",
                 "import ferrox_kv.store", "from . import store", "cimport ferrox_kv._x"):
        assert IMPORT.search(line), line
    for line in ("    see ``ferrox_kv.store.save_prefixes``.", "# ferrox_kv.store uses it"):
        assert not IMPORT.search(line), line


def test_the_store_does_not_import_the_core_at_module_level():
    for path in STORE_MODULES:
        tree = ast.parse(path.read_text())
        for node in tree.body:                  # module level only; functions may
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                # ``ferrox_kv`` itself (``from ferrox_kv import KvCache``) loads the core
                assert not (name == "ferrox_kv" or name.startswith("ferrox_kv._core")), (
                    f"{path.name}:{node.lineno} imports {name}")


RUN_THE_CORE = r"""
import json, sys
import numpy as np
import ferrox_kv._core as core
by_the_package = sorted(m for m in sys.modules if m.startswith("ferrox_kv"))

class Store:            # what attach needs, and what main's check asked for
    def __init__(self): self.calls = []
    def after_publish(self, pool, caches, tokens, salt): self.calls.append("publish")
    def before_lookup(self, pool, tokens, salt, n_layers): self.calls.append("lookup")
    def put_chain(self, *a, **k): return 0
    def get_chain(self, *a, **k): return []
    def stats(self): return {"n": len(self.calls)}

pool = core.KvBlockPool(4, 16, 2, 8, prefix_cache=True)
store = Store()
pool.attach(store)
toks = list(range(9))
c = core.KvCache.with_pool(2, 8, pool, 16, tokens=toks)
c.extend(np.ones((8, 2, 8), np.float32), np.ones((8, 2, 8), np.float32))
pool.publish([c], toks[:8])
d = core.KvCache.with_pool(2, 8, pool, 16, tokens=toks)
exported = pool._export_prefixes()
assert pool._prefix_match(toks) == 2
assert pool.stats()["store_n"] == 3
c.close(); d.close()
pool.check()
print(json.dumps([store.calls, by_the_package,
                  sorted(m for m in sys.modules if m.startswith("ferrox_kv"))]))
"""


def test_the_core_imports_no_ferrox_kv_module_at_run_time():
    p = subprocess.run([sys.executable, "-c", RUN_THE_CORE], capture_output=True, text=True,
                       timeout=120, cwd=REPO / "tests")
    assert p.returncode == 0, p.stderr
    calls, by_the_package, loaded = json.loads(p.stdout.splitlines()[-1])
    assert calls == ["lookup", "publish", "lookup"]
    # the package's __init__ runs first (it imports the core and its own
    # small modules, never the store); running the core loads nothing more
    assert "ferrox_kv._core" in by_the_package
    assert not any(m.startswith(("ferrox_kv.store", "ferrox_kv.hf", "ferrox_kv.serve"))
                   for m in by_the_package), by_the_package
    assert loaded == by_the_package, loaded


def test_the_file_forwards_need_the_package():
    # the core forwards save/load to what the package handed it, never importing it
    import ferrox_kv
    from ferrox_kv import _core
    old = _core._set_store_files(None)
    try:
        with pytest.raises(RuntimeError, match="import ferrox_kv"):
            ferrox_kv.KvBlockPool(4, 8, 2, 8, prefix_cache=True).save_prefixes(
                "unused", fingerprint="m")
    finally:
        assert _core._set_store_files(old) is None
