"""A ``ferrox-kv serve`` process on loopback, as the server tests and the
load test (``benchmarks/serve_load.py``) start it: a free port, the
process (``python -m ferrox_kv.serve``) run outside any checkout with its
output in a log file, ready once ``/health`` answers 200; its resident
memory; SIGTERM and the exit status.

Only the standard library (``urllib`` for ``/health``), so that it runs
wherever the server does.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

__all__ = ["ServerProcess", "free_port", "rss_kib"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> int:
    """Resident memory of process ``pid`` in KiB (``VmRSS``, Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS line")


class ServerProcess:
    """``python -m ferrox_kv.serve MODEL_DIR --port P ARGS...`` with cwd
    ``workdir`` (a new temporary directory when None: outside the checkout,
    so the installed package is the one imported), its output in
    ``log_path``; the constructor returns once ``/health`` answers 200, or
    raises ``RuntimeError`` with the log when the process exits or
    ``start_timeout`` seconds pass.

    The environment adds ``PYTHONUNBUFFERED=1``, ``HF_HUB_OFFLINE=1``,
    ``TRANSFORMERS_OFFLINE=1`` and ``OMP_NUM_THREADS`` (the caller's, else 1).
    """

    def __init__(self, model_dir, *args, workdir=None, start_timeout=180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir or tempfile.mkdtemp(prefix="ferrox-serve-")
        self.log_path = os.path.join(self.workdir, f"serve-{self.port}.log")
        self._log = open(self.log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ferrox_kv.serve", str(model_dir), "--port", str(self.port),
             *map(str, args)], cwd=self.workdir, stdout=self._log, stderr=subprocess.STDOUT,
            env=env)
        self._wait_ready(start_timeout)

    def _wait_ready(self, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not come up in {timeout} s:\n{self.log()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def health(self) -> dict:
        """``GET /health`` as a dict."""
        with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
            return json.loads(r.read())

    def wait_idle(self, timeout=60.0) -> dict:
        """``/health`` once nothing runs or waits (a departed client's blocks
        come back at the engine's next step), or after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while True:
            h = self.health()
            if (h["running"] == 0 and h["waiting"] == 0) or time.monotonic() > end:
                return h
            time.sleep(0.05)

    def rss_kib(self) -> int:
        """The server's resident memory now, KiB."""
        return rss_kib(self.proc.pid)

    def log(self) -> str:
        """Everything the server printed so far."""
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, timeout=60.0) -> int:
        """SIGTERM (the server drains), wait up to ``timeout`` seconds, then
        SIGKILL; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
