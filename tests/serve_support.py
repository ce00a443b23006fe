"""What the server tests share: a model directory made offline
(``ferrox_kv.serve.tiny``: a tiny random Llama saved with save_pretrained, a
byte-level BPE tokenizer trained with the ``tokenizers`` library, wrapped in
PreTrainedTokenizerFast, with a chat template) and a real ``python -m
ferrox_kv.serve`` process on a free loopback port."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from ferrox_kv.serve.tiny import CHAT_TEMPLATE, SYSTEM, TEXT, make_model_dir  # noqa: F401


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m ferrox_kv.serve MODEL_DIR --port P ARGS...`` run outside
    the checkout (cwd ``workdir``), its output in a log file."""

    def __init__(self, model_dir, workdir, *args, start_timeout=180):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(workdir, f"serve-{self.port}.log")
        self._log = open(self.log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ferrox_kv.serve", model_dir, "--port", str(self.port),
             *map(str, args)], cwd=workdir, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(start_timeout)

    def _wait_ready(self, timeout):
        import httpx

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not come up in {timeout} s:\n{self.log()}")

    def health(self):
        import httpx

        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_idle(self, timeout=60):
        """/health once nothing runs or waits (blocks come back at the
        engine's next step after a client leaves)."""
        end = time.monotonic() + timeout
        while True:
            h = self.health()
            if (h["running"] == 0 and h["waiting"] == 0) or time.monotonic() > end:
                return h
            time.sleep(0.05)

    def log(self):
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, timeout=60):
        """SIGTERM and wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
