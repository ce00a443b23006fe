"""benchmarks/serve_load.py: the plot (throughput and p99 latency against
N, one series per server mode) and, on the tiny model with a few requests,
every row of the script (in three runs), the tables, the JSON and the plot."""
import importlib.util
import json
import os
import pathlib

import pytest

if os.environ.get("CI") or os.environ.get("FERROX_KV_REQUIRE_INSTALLED"):
    import matplotlib  # noqa: F401  (in CI a missing [plot] or serve dependency fails)
    import httpx  # noqa: F401
pytest.importorskip("matplotlib")
pytest.importorskip("httpx")

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def serve_load():
    spec = importlib.util.spec_from_file_location("serve_load",
                                                  REPO / "benchmarks" / "serve_load.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _colour_share(img, hex_colour):
    import numpy as np

    rgb = np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return float((np.abs(img[..., :3] - rgb).max(-1) < 0.05).mean())


def test_the_plot_has_throughput_and_p99_against_n_for_both_modes(serve_load, tmp_path):
    import matplotlib.image

    rows = []
    for mode, tps in (("batch", 100.0), (serve_load.BASELINE, 25.0)):
        for n in (16, 1, 64, 4):
            rows.append({"mode": mode, "clients": n, "tokens_per_s": tps * n ** 0.5,
                         "p99_latency_s": 0.1 * n})
    rows.append({"mode": "pool for 8 (96 blocks)", "requests": 64, "share_ok": 1.0})
    path = tmp_path / "serve.png"
    series = serve_load.plot(rows, str(path), ["batch", serve_load.BASELINE])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(series) == ["batch", serve_load.BASELINE]
    for mode, tps in (("batch", 100.0), (serve_load.BASELINE, 25.0)):
        ns, tput, p99 = series[mode]
        assert ns == [1, 4, 16, 64]
        assert tput == [tps * n ** 0.5 for n in ns] and p99 == [0.1 * n for n in ns]
    img = matplotlib.image.imread(str(path))
    for colour in ("#1f77b4", "#ff7f0e"):           # matplotlib's first two series colours
        assert _colour_share(img, colour) > 1e-4, colour


# The script's rows in three runs, so that xdist spreads them over its
# workers (one run of every row was the suite's longest test): each run
# asserts the rows, tables and files it makes.
PARTS = {
    "batch, DynamicCache, generate_batch": ["--modes", "batch", "threads-dynamic",
                                            "--clients", "1", "16", "--no-overload",
                                            "--generate-batch"],
    "ferrox threads": ["--modes", "threads-ferrox", "--clients", "1", "16", "--no-overload"],
    "pool for 8, soak": ["--modes", "threads-ferrox", "--clients", "1", "--soak", "40"],
}


@pytest.mark.long
@pytest.mark.parametrize("part", list(PARTS))
def test_a_short_run_of_the_load_test(part, tmp_path):
    """Every row of the script on the tiny model, a few requests each,
    over the three parts: both baselines, prefix cache off, the pool for
    8, the soak, and generate_batch; the tables, the JSON and the plot."""
    import subprocess
    import sys

    pytest.importorskip("transformers")
    from ferrox_kv.serve.tiny import make_model_dir

    model = make_model_dir(tmp_path / "tiny")
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "serve_load.py"), "--model-dir", model,
         "--soak-model-dir", model, "--requests", "1", "--max-tokens", "3", *PARTS[part],
         "--json", str(tmp_path / "rows.json"), "--plot", str(tmp_path / "serve.png")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads((tmp_path / "rows.json").read_text())
    modes = {(r["mode"], r.get("clients")) for r in rows}
    for r in rows:
        if "statuses" in r and not r["mode"].startswith(("pool for 8", "soak")):
            assert r["statuses"] == {"200": r["requests"]}, r
    assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"
    if part == "batch, DynamicCache, generate_batch":
        for mode in ("batch", "threads (DynamicCache)"):
            assert {(mode, 1), (mode, 16)} <= modes, modes
        assert ("batch --no-prefix-cache", 16) in modes
        assert ("generate_batch (in process)", 16) in modes
        for what in ("batch vs threads with DynamicCache", "vs generate_batch",
                     "cached vs prefix cache off"):
            assert what in out.stdout, what
    elif part == "ferrox threads":
        assert {("threads (ferrox)", 1), ("threads (ferrox)", 16)} <= modes, modes
    else:
        pool8 = next(r for r in rows if r["mode"].startswith("pool for 8"))
        assert pool8["share_ok"] == 1.0 and pool8["used_blocks_after"] == 0 and pool8["exit"] == 0
        soak = next(r for r in rows if r["mode"].startswith("soak"))
        assert soak["ran"] == 40 and soak["blocks_lost"] == 0 and soak["exit"] == 0
        assert soak["rss_kib_end"] <= 1.15 * soak["rss_kib_start"] + 16 * 1024, soak
        for what in ("pool for 8", "blocks lost after the soak"):
            assert what in out.stdout, what


def test_a_request_that_fails_in_transport_is_counted_not_raised(serve_load):
    """64 clients in threads mode met httpx.ReadError and the script died
    before its table: a transport error is a counted status now."""
    import asyncio
    import random

    import httpx

    def handler(request):
        raise httpx.ReadError("connection reset", request=request)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await serve_load.one(client, "http://x", "p", 4)

    assert asyncio.run(go())[0] == "error:ReadError"

    real = httpx.AsyncClient

    class Failing(real):
        def __init__(self, **kw):
            super().__init__(transport=httpx.MockTransport(handler), **kw)

    serve_load.httpx.AsyncClient = Failing
    try:
        row = asyncio.run(serve_load.load("http://x", 3, 2, 4, random.Random(0), "s "))
    finally:
        serve_load.httpx.AsyncClient = real
    assert row["errors"] == 6 and row["statuses"] == {"error:ReadError": 6}
    assert "| 6 |" in serve_load.per_n([{**row, "mode": "batch"}], ["batch"])[-1]


def test_every_server_started_is_stopped_when_a_health_check_fails(serve_load, monkeypatch):
    """A health check that times out during clean-up used to skip the stop
    step and leave the server running."""
    stopped = []

    class Proc:
        def __init__(self):
            self.rc = None

        def poll(self):
            return self.rc

    class Srv:
        url = "http://x"

        def __init__(self, *a, **kw):
            self.proc = Proc()

        def wait_idle(self, timeout=60.0):
            raise TimeoutError("health check timed out")

        def rss_kib(self):
            return 1

        def stop(self, timeout=60.0):
            stopped.append(self)
            self.proc.rc = 0
            return 0

        def log(self):
            return "ferrox-kv serve: stopped\n"

    async def fake_load(*a, **kw):
        return {"statuses": {"200": 1}, "requests": 1, "errors": 0}

    monkeypatch.setattr(serve_load, "ServerProcess", Srv)
    monkeypatch.setattr(serve_load, "load", fake_load)
    monkeypatch.setattr(serve_load, "STARTED", [])

    class Args:
        kv_blocks, torch_threads, requests, max_tokens = 64, 1, 1, 2

    rows, h, rc, _ = serve_load.run_mode("m", "batch", [1, 4], Args, "s")
    assert len(rows) == 2 and h is None and rc == 0 and len(stopped) == 1

    def boom(*a, **kw):
        raise RuntimeError("the load itself failed")

    monkeypatch.setattr(serve_load, "load", boom)
    with pytest.raises(RuntimeError):
        serve_load.run_mode("m", "batch", [1], Args, "s")
    assert len(stopped) == 2
    serve_load.start("m")                      # started, never stopped by its row
    serve_load.stop_all()
    assert len(stopped) == 3 and all(s.proc.poll() == 0 for s in serve_load.STARTED)
