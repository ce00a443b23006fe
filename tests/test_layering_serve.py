"""``ferrox_kv.serve`` stands on public names only: from ``ferrox_kv.hf``
the names it exports without an underscore, and nothing private of the
core (``ferrox_kv._core``, or any underscore name of ``ferrox_kv``).
Read from the sources (no import: torch is not needed), as
test_bench_package.py reads the bench's."""
from __future__ import annotations

import ast
import pathlib

import pytest

SERVE = pathlib.Path(__file__).resolve().parents[1] / "ferrox_kv" / "serve"


def _private_uses(path: pathlib.Path) -> list[str]:
    """What ``path`` takes of the core or hf that is private: imported
    underscore names, underscore modules, and underscore attributes read
    off a name bound to ``ferrox_kv``, ``ferrox_kv.hf`` or the core."""
    tree = ast.parse(path.read_text(), str(path))
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mod = node.module
            parts = mod.split(".")
            if parts[0] != "ferrox_kv" or (len(parts) > 1 and parts[1] not in ("_core", "hf")
                                           and not parts[1].startswith("_")):
                continue                          # serve's own modules, the store: not ours here
            if any(p.startswith("_") for p in parts):
                found.append(f"{path.name}:{node.lineno}: from {mod} import ...")
                continue
            for a in node.names:
                if a.name.startswith("_"):
                    found.append(f"{path.name}:{node.lineno}: from {mod} import {a.name}")
                elif mod == "ferrox_kv" and a.name == "hf":
                    aliases[a.asname or a.name] = "ferrox_kv.hf"
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "ferrox_kv" and any(p.startswith("_") for p in parts):
                    found.append(f"{path.name}:{node.lineno}: import {a.name}")
                elif parts[0] == "ferrox_kv":
                    aliases[a.asname or "ferrox_kv"] = a.name if a.asname else "ferrox_kv"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            base = ast.unparse(node.value)
            if base in aliases or base.startswith("ferrox_kv"):
                found.append(f"{path.name}:{node.lineno}: {base}.{node.attr}")
    return found


def test_serve_uses_public_hf_names_and_nothing_private_of_the_core():
    files = sorted(SERVE.glob("*.py"))
    assert len(files) >= 8, files            # the package is where this test looks
    found = [use for f in files for use in _private_uses(f)]
    assert not found, "ferrox_kv.serve takes private names:\n" + "\n".join(found)


@pytest.mark.parametrize("source,private", [
    ("from ferrox_kv.hf import ATTENTION, _rows\n", True),
    ("from ferrox_kv._core import _extend_each\n", True),
    ("from ferrox_kv.hf.cache import _SeqsLayer\n", True),
    ("import ferrox_kv._core\n", True),
    ("import ferrox_kv.hf as h\nh._rows(1)\n", True),
    ("import ferrox_kv\nferrox_kv._core._assign([], [])\n", True),
    ("from ferrox_kv.hf import ATTENTION, PackedCache, kv_geometry\n", False),
    ("from ferrox_kv import KvCache\nfrom ferrox_kv.serve.text import TextStream\n", False),
    ("from ferrox_kv.store import RedisPrefixStore\n", False),
])
def test_the_check_sees_each_kind_of_private_use(tmp_path, source, private):
    f = tmp_path / "mod.py"
    f.write_text(source)
    assert bool(_private_uses(f)) == private
