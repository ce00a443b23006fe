"""The serve engine in process: the Retry-After estimate, the never-fits
check, and the FIFO head that nobody overtakes (no server, no HTTP)."""
import os

import pytest

if os.environ.get("CI") or os.environ.get("FERROX_KV_REQUIRE_INSTALLED"):
    import fastapi  # noqa: F401  (in CI a missing serve dependency fails, never skips)
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")

import serve_support as S  # noqa: E402

from ferrox_kv import KvBlockPool  # noqa: E402


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    import ferrox_kv.hf  # noqa: F401

    d = S.make_model_dir(tmp_path_factory.mktemp("m") / "m", hidden=32, heads=2, kv_heads=1)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="ferrox")
    return model, tok


def _engine(parts, blocks=32, **kw):
    from ferrox_kv.serve.engine import Engine

    model, tok = parts
    pool = KvBlockPool(16, blocks, 1, 16, prefix_cache=True)
    return Engine(model, tok, pool, **kw)


def _req(n_prompt, max_tokens, done=0):
    from ferrox_kv.serve.engine import Request, Sampling

    r = Request(list(range(3, 3 + n_prompt)), max_tokens, Sampling(0))
    r.output_ids = [5] * done
    r.first_token_at = 1.0 if done else None
    return r


def test_retry_after_is_the_remaining_tokens_of_the_request_whose_end_frees_enough(parts):
    e = _engine(parts, blocks=32)              # 2 layers: a 64-position request takes 8 blocks
    e._step_ema = 0.1
    short, long_ = _req(8, 56, done=46), _req(8, 56, done=6)     # 10 and 50 tokens left
    e._running = [long_, short]
    held = e.pool.allocate(32)                  # the pool is full
    try:
        assert e.retry_after(_req(8, 56)) == 1             # the short one's end frees 8
        assert e.retry_after(_req(8, 120)) == 5            # 16 blocks: both must end
        e._queue.append(_req(8, 56))                       # one ahead in the queue
        assert e.retry_after(_req(8, 56)) == 5
    finally:
        e.pool.free(held)
        e._running, e._queue = [], type(e._queue)()


def test_a_request_beyond_the_pool_or_the_context_never_fits(parts):
    from ferrox_kv.serve.engine import NeverFits

    e = _engine(parts, blocks=8)                # 4 blocks per layer: 64 positions
    e.check_fits(_req(8, 56))
    with pytest.raises(NeverFits, match="--kv-blocks") as err:
        e.check_fits(_req(8, 57))
    assert err.value.param == "max_tokens"
    with pytest.raises(NeverFits, match="context"):
        _engine(parts, blocks=4096).check_fits(_req(1000, 100))
    assert e.pool.used_blocks == 0


def test_the_queue_head_waits_and_nobody_overtakes_it(parts):
    """FIFO: a small request behind a large one that does not fit waits too,
    and the pool is left untouched by the refusal."""
    e = _engine(parts, blocks=16)
    big, small = _req(8, 120), _req(2, 2)       # big needs all 16 blocks
    held = e.pool.allocate(4)
    try:
        e._queue.extend([big, small])
        e._admit()
        assert list(e._queue) == [big, small] and e._running == []
        assert e.pool.used_blocks == 4
    finally:
        e.pool.free(held)
    e._admit()
    assert e._running == [big] and list(e._queue) == [small]   # the pool is big's now
    with e._cv:
        e._retire(big, publish=False)
        e._admit()
        assert e._running == [small]
        e._retire(small, publish=False)
    assert e.pool.used_blocks == 0
    e.pool.check()


def test_the_serve_subcommand_and_a_missing_model_dir(tmp_path):
    """``ferrox-kv serve`` is a subcommand of the one command; a path that is
    not a directory stops with a message that says what to pass."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "ferrox_kv", "serve", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for opt in ("--kv-gib", "--kv-blocks", "--block-size", "--dtype", "--mode", "--max-batch",
                "--max-queue", "--queue-timeout", "--host", "--port"):
        assert opt in out.stdout
    out = subprocess.run([sys.executable, "-m", "ferrox_kv.serve", str(tmp_path / "missing")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "is not a directory" in out.stderr and "save_pretrained" in out.stderr
