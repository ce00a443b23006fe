"""Prefix files on disk: written atomically, read whole and verified."""
from __future__ import annotations

import errno
import os
import secrets
import stat
from typing import IO, Any, Callable, Sequence, TypeVar

import numpy as np

from ferrox_kv.store._format import (Decoded, Entry, Geometry, decode_file, read_into,
                                     write_file)

T = TypeVar("T")


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], T]) -> T:
    """Call ``write(f)`` on a new temporary file in ``path``'s directory, flush and
    fsync it, rename it over ``path`` and fsync the directory. A crash at any
    point leaves either the old file or the new one at ``path``, whole; on an
    exception the temporary file is removed and ``path`` is untouched. The
    new file has the old one's permission bits (a new one: 0o666 less the
    umask); a symbolic link at ``path`` keeps pointing at the new file."""
    path = os.path.realpath(os.fspath(path))      # a symbolic link: its target is replaced
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    try:                                              # a file saved over keeps its mode
        mode: int | None = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = None
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                 0o666 if mode is None else 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return result


def save_file(path: str | os.PathLike[str], geometry: Geometry, fingerprint: Any,
              entries: Sequence[Entry], *, flags: int = 0) -> int:
    """Write a prefix file atomically (see ``atomic_write``); returns its bytes.
    Entries are validated before anything is written; ``flags`` as for
    ``write_file``."""
    return atomic_write(path, lambda f: write_file(f, geometry, fingerprint, entries,
                                                   flags=flags))


def load_file(path: str | os.PathLike[str], *, geometry: Geometry | None = None,
              fingerprint: Any = None) -> Decoded:
    """Read a prefix file whole into one private buffer and verify every entry
    (``decode_file``) before returning any; the entries' arrays are views of
    that buffer."""
    return decode_file(read_whole(path), geometry=geometry, fingerprint=fingerprint)


def open_regular(path: str | os.PathLike[str]) -> IO[bytes]:
    """``path`` opened for reading, unbuffered, if it is a regular file: a FIFO
    or a device is a ``ValueError`` (opening never waits for a writer), a
    directory ``IsADirectoryError``."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "a prefix file is a file, not a directory",
                                    os.fspath(path))
        if not stat.S_ISREG(mode):
            raise ValueError(f"{os.fspath(path)!r} is not a regular file (a FIFO, socket or "
                             "device): prefix and conversation files are read whole")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def read_whole(path: str | os.PathLike[str]) -> np.ndarray:
    """The bytes of a file, read into one private uint8 buffer (a file that
    shrank while being read gives fewer bytes: a truncated one)."""
    with open_regular(path) as f:
        buf = np.empty(os.fstat(f.fileno()).st_size, np.uint8)
        with memoryview(buf) as view:
            got = read_into(f, 0, view)
    return buf[:got]
