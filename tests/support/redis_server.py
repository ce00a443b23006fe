"""A real redis-server for the store tests (Debian's package): one server
on loopback, or a three-node Redis Cluster, each stopped when done."""
import contextlib
import os
import random
import shutil
import socket
import subprocess
import time

import pytest


def _redis_missing():
    """Why the Redis tests cannot run here, or None."""
    if shutil.which("redis-server") is None:
        return "no redis-server binary on PATH (apt-get install redis-server)"
    try:
        import redis  # noqa: F401
        import xxhash  # noqa: F401
    except ModuleNotFoundError as e:
        return f"the redis extra is not installed ({e.name}): pip install '.[redis]'"
    return None


def require_redis():
    """The redis module, for a test module that needs a redis-server; the
    module is skipped with the reason where there is none, except in CI
    (CI=true), where that fails it."""
    why = _redis_missing()
    if why is not None:
        if os.environ.get("CI") == "true":
            raise RuntimeError(f"CI must run the Redis tests, but {why}")
        pytest.skip(why, allow_module_level=True)
    import redis
    return redis


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_port_with_bus():
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(200):
        port = random.randint(20000, 29999)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """One redis-server on 127.0.0.1, no persistence, DEBUG allowed (for
    DEBUG SLEEP); stopped with SIGTERM (then SIGKILL)."""

    # what this server runs with beyond the port, the folder and no persistence
    extra = ("--enable-debug-command", "yes")

    def __init__(self, folder, port=None):
        self.folder, self.port, self.proc = str(folder), port, None
        # the environment of the server: not the suite's ASan preload
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("LD_PRELOAD", "ASAN_OPTIONS")}

    def _port(self):
        return self.port or _free_port()

    def start(self):
        import redis
        for _ in range(20):
            port = self._port()
            self.proc = subprocess.Popen(
                [shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                 "--dir", self.folder, "--save", "", "--appendonly", "no", *self.extra,
                 "--daemonize", "no", "--logfile", os.path.join(self.folder, "redis.log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    redis.Redis(port=port, socket_timeout=1).ping()
                    self.port = port
                    return self
                except redis.RedisError:
                    time.sleep(0.02)
            self.stop()
            if self.port:                           # a fixed port: no other to try
                break
        raise RuntimeError(f"redis-server did not start (see {self.folder}/redis.log)")

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kw):
        import redis
        return redis.Redis(port=self.port, socket_timeout=10, **kw)


class ClusterNode(RedisServer):
    extra = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")

    def _port(self):
        return _free_port_with_bus()


@contextlib.contextmanager
def cluster(folder):
    """A three-node Redis Cluster on loopback (no replicas) in subfolders of
    ``folder``, made with redis-cli --cluster create; yields its nodes and
    stops them on exit. Skipped without redis-cli, except in CI (CI=true),
    where that fails."""
    import redis
    cli = shutil.which("redis-cli")
    if cli is None:
        if os.environ.get("CI") == "true":
            raise RuntimeError("CI must run the cluster test, but redis-cli is missing "
                               "(Debian's redis-tools, which redis-server depends on)")
        pytest.skip("no redis-cli binary (apt-get install redis-tools)")
    nodes = []
    try:
        for i in range(3):
            node_folder = folder / f"node{i}"
            node_folder.mkdir()
            nodes.append(ClusterNode(node_folder).start())
        out = subprocess.run([cli, "--cluster", "create",
                              *[f"127.0.0.1:{n.port}" for n in nodes],
                              "--cluster-replicas", "0", "--cluster-yes"],
                             capture_output=True, text=True, timeout=60, env=nodes[0].env)
        assert out.returncode == 0, out.stdout + out.stderr
        # every node must see the whole cluster (all slots, three nodes), not
        # only the one that ran the create: a client that asks another one
        # too early is told CLUSTERDOWN
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            infos = [redis.Redis(port=n.port).execute_command("CLUSTER", "INFO") for n in nodes]
            if all(b"cluster_state:ok" in i and b"cluster_known_nodes:3" in i
                   and b"cluster_slots_ok:16384" in i for i in infos):
                break
            time.sleep(0.1)
        else:
            raise RuntimeError("the cluster did not reach cluster_state:ok on every node")
        yield nodes
    finally:
        for n in nodes:
            n.stop()
