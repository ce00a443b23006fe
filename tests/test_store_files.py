"""Prefix files on disk: atomic replacement (a killed save leaves the previous
file whole), verified whole reads."""
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from support.pools import require_store

require_store()

from ferrox_kv.store import (  # noqa: E402
    Geometry,
    StoreCorrupt,
    StoreMismatch,
    atomic_write,
    entries_from_rows,
    load_file,
    save_file,
)

G = Geometry(16, 2, 2, 8, 8)
FP = "model@1"


def _entries(n_tokens, seed):
    rng = np.random.default_rng(seed)
    k = [rng.standard_normal((n_tokens, 16)).astype(np.float32) for _ in range(2)]
    v = [rng.standard_normal((n_tokens, 16)).astype(np.float32) for _ in range(2)]
    return entries_from_rows(G, rng.integers(0, 1000, n_tokens), k, v, salt="s")


def _same(a, b):
    return len(a) == len(b) and all(
        x.key == y.key and np.array_equal(x.k, y.k) and np.array_equal(x.v, y.v)
        and np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))


def test_save_then_load_round_trips_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "prefixes.fxkv"
    entries = _entries(64, 0)
    n = save_file(path, G, FP, entries)
    assert n == os.path.getsize(path)
    d = load_file(path, geometry=G, fingerprint=FP)
    assert _same(d.entries, entries)
    save_file(path, G, FP, _entries(32, 1))                      # replaced whole
    assert _same(load_file(path).entries, _entries(32, 1))
    assert os.listdir(tmp_path) == ["prefixes.fxkv"]


def test_load_refuses_another_fingerprint_and_a_truncated_file(tmp_path):
    path = tmp_path / "p.fxkv"
    save_file(path, G, FP, _entries(48, 0))
    with pytest.raises(StoreMismatch, match="fingerprint"):
        load_file(path, geometry=G, fingerprint="model@2")
    with pytest.raises(StoreMismatch, match="n_layers"):
        load_file(path, geometry=G._replace(n_layers=3), fingerprint=FP)
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(StoreCorrupt, match="truncated"):
        load_file(path, geometry=G, fingerprint=FP)


def test_a_failing_writer_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = tmp_path / "p.fxkv"
    save_file(path, G, FP, _entries(32, 0))
    before = path.read_bytes()

    def fail(f):
        f.write(b"half a file")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, fail)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["p.fxkv"]


def test_bad_entries_raise_before_a_file_is_created(tmp_path):
    entries = _entries(32, 0)
    with pytest.raises(ValueError, match="parent"):
        save_file(tmp_path / "p.fxkv", G, FP, entries[1:])
    assert os.listdir(tmp_path) == []


def test_the_file_and_its_directory_are_fsynced_before_and_after_the_rename(tmp_path,
                                                                            monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(a, b):
        calls.append(("replace",))
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save_file(tmp_path / "p.fxkv", G, FP, _entries(16, 0))
    assert calls == [("fsync", False), ("replace",), ("fsync", True)]


def test_a_save_killed_midway_leaves_the_previous_file_intact(tmp_path):
    path = tmp_path / "p.fxkv"
    old = _entries(64, 0)
    save_file(path, G, FP, old)
    before = path.read_bytes()
    # the child saves a large file slowly (a sleep after each write), so the
    # kill lands while the temporary file is half written
    child = textwrap.dedent(f"""
        import sys, time
        import numpy as np
        from ferrox_kv.store import Geometry, atomic_write, entries_from_rows, write_file
        g = Geometry(16, 2, 2, 8, 8)
        rng = np.random.default_rng(3)
        rows = lambda: [rng.standard_normal((4096, 16)).astype(np.float32) for _ in range(2)]
        entries = entries_from_rows(g, rng.integers(0, 1000, 4096), rows(), rows(), salt="s")

        class Slow:
            def __init__(self, f):
                self.f = f
            def write(self, b):
                n = self.f.write(b)
                self.f.flush()
                print("wrote", flush=True)
                time.sleep(0.01)
                return n

        atomic_write({str(path)!r}, lambda f: write_file(Slow(f), g, "model@1", entries))
        print("done", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True,
                            cwd=str(tmp_path))
    try:
        for _ in range(50):                  # about 50 writes in: mid-file
            line = proc.stdout.readline()
            assert line == "wrote\n", line
        temps = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
        assert len(temps) == 1 and os.path.getsize(tmp_path / temps[0]) > 0
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert path.read_bytes() == before
    assert _same(load_file(path, geometry=G, fingerprint=FP).entries, old)
    # the killed save's temporary file is the only trace; a later save is unaffected
    save_file(path, G, FP, _entries(16, 2))
    assert _same(load_file(path).entries, _entries(16, 2))


def test_load_refuses_bytes_after_the_trailer_and_an_empty_file(tmp_path):
    path = tmp_path / "p.fxkv"
    save_file(path, G, FP, _entries(32, 0))
    data = path.read_bytes()
    path.write_bytes(data + b"x" * 10)
    with pytest.raises(StoreCorrupt, match="trailing"):
        load_file(path)
    path.write_bytes(b"")
    with pytest.raises(StoreCorrupt, match="truncated"):
        load_file(path)


def test_a_file_saved_over_keeps_its_mode_and_a_link_keeps_its_target(tmp_path):
    path = tmp_path / "private.fxkv"
    save_file(path, G, FP, _entries(32, 0))
    os.chmod(path, 0o600)
    save_file(path, G, FP, _entries(32, 1))
    assert os.stat(path).st_mode & 0o777 == 0o600              # never made world-readable
    link = tmp_path / "current.fxkv"
    os.symlink(path, link)
    save_file(link, G, FP, _entries(16, 2))
    assert os.path.islink(link) and os.readlink(link) == str(path)
    assert _same(load_file(path).entries, _entries(16, 2))
    assert sorted(os.listdir(tmp_path)) == ["current.fxkv", "private.fxkv"]


def test_a_fifo_at_the_path_is_refused_at_once_not_waited_on(tmp_path):
    """Opening a FIFO for reading would wait for a writer: every loader
    checks for a regular file first."""
    from ferrox_kv import KvBlockPool, KvCache
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    pool = KvBlockPool(16, 8, 2, 8, prefix_cache=True)
    for load in (lambda: load_file(fifo), lambda: KvCache.load(fifo),
                 lambda: pool.load_prefixes(fifo, fingerprint=FP)):
        with pytest.raises(ValueError, match="not a regular file"):
            load()
    with pytest.raises(IsADirectoryError):
        load_file(tmp_path)
    pool.check()
    assert pool.free_blocks == 8
