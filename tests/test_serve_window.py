"""The serve engine over a model with sliding-window layers (a tiny random
Gemma 3: five sliding layers of six): admission reserves each layer's need,
so a pool that fits N whole requests runs more than N windowed ones at once,
with the same greedy tokens as with windows off; ``/metrics`` counts the
blocks the windows gave back; no prefix is reused; every block comes back."""
import os

import pytest

if os.environ.get("CI") or os.environ.get("FERROX_KV_REQUIRE_INSTALLED"):
    import fastapi  # noqa: F401  (in CI a missing serve dependency fails, never skips)
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from support import serve as S  # noqa: E402

from ferrox_kv import KvBlockPool  # noqa: E402

BS, WINDOW, CHUNK = 4, 8, 4
PROMPT, MAX_TOKENS = 12, 28               # 40 positions: 10 blocks of a full layer
WHOLE = 6 * 10                            # a request's blocks, every layer whole
WINDOWED = 10 + 5 * (-(-(WINDOW + CHUNK - 1) // BS) + 1)     # full layer + 5 windows of 4


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    import ferrox_kv.hf  # noqa: F401

    d = S.make_model_dir(tmp_path_factory.mktemp("m") / "m", hidden=32, heads=2, kv_heads=1)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    torch.manual_seed(26)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=WINDOW,
        max_position_embeddings=512, attn_implementation="ferrox")
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    return model, tok


def _engine(parts, blocks, **kw):
    from ferrox_kv.serve.engine import Engine
    from ferrox_kv.serve.metrics import Metrics

    model, tok = parts
    pool = KvBlockPool(BS, blocks, 1, 16, prefix_cache=True)
    metrics = Metrics(pool)
    e = Engine(model, tok, pool, prefill_chunk=CHUNK, max_batch=8, metrics=metrics, **kw)
    metrics.engine = e
    e.eos = set()                         # every request runs its max_tokens
    return e


def _requests(n):
    from ferrox_kv.serve.engine import Request, Sampling

    return [Request([3 + (7 * i + j) % 200 for j in range(PROMPT)], MAX_TOKENS, Sampling(0))
            for i in range(n)]


def _metric(e, name):
    for line in e.metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _dynamic_cache_tokens(model, ids):
    """Greedy ``generate`` over DynamicCache (its sliding layers' own), no EOS."""
    from transformers import DynamicCache

    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                             dtype=torch.long), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=[], cache=DynamicCache(config=model.config))
    return out[0, len(ids):].tolist()


def _run(e, reqs):
    """Every request to its end, stepping the engine by hand: the most that
    ran at once, and each sliding cache's blocks given back at retirement."""
    freed, retire = [], e._retire

    def counting(r, publish):
        if r.caches is not None:
            freed.append(sum(c.first_pos // BS for c in r.caches if c.window))
        retire(r, publish)

    e._retire = counting
    e._queue.extend(reqs)
    most = 0
    with torch.inference_mode():
        while e._queue or e._running:
            with e._cv:
                e._admit()
            most = max(most, len(e._running))
            e._step(list(e._running))
    return most, sum(freed)


def test_a_pool_for_two_whole_requests_runs_four_windowed_ones_with_the_same_tokens(parts):
    on, off = _engine(parts, 2 * WHOLE), _engine(parts, 2 * WHOLE, sliding_windows=False)
    assert on.windows == [WINDOW] * 5 + [None] and off.windows == [None] * 6
    assert (on.blocks_for(PROMPT + MAX_TOKENS), off.blocks_for(PROMPT + MAX_TOKENS)) == (
        WINDOWED, WHOLE)
    assert 4 * WINDOWED == on.pool.total_blocks
    before = _metric(on, "ferrox:kv_blocks_window_freed_total")
    got, want = _requests(4), _requests(4)
    most_on, freed = _run(on, got)
    most_off, _ = _run(off, want)
    assert (most_on, most_off) == (4, 2)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert all(len(r.output_ids) == MAX_TOKENS for r in got)
    assert got[0].output_ids == _dynamic_cache_tokens(parts[0], got[0].prompt_ids)
    assert freed > 0 and on.pool.stats()["window_freed"] == freed
    assert _metric(on, "ferrox:kv_blocks_window_freed_total") == before + freed
    assert _metric(off, "ferrox:kv_blocks_window_freed_total") == 0
    # windows on: no prefix looked up or published (FerroxCache's rule); off: as ever
    assert on.pool.cached_blocks == 0 and _metric(on, "ferrox:prefix_cache_queries_total") == 0
    assert off.pool.cached_blocks > 0
    for e in (on, off):
        assert e.pool.used_blocks == 0 and e.pool.free_blocks == e.pool.total_blocks
        e.pool.check()


def test_admission_reserves_what_blocks_for_says(parts):
    e = _engine(parts, 4 * WINDOWED)
    reqs = _requests(4)
    with e._cv:
        e._queue.extend(reqs)
        e._admit()
        assert len(e._running) == 4 and e.pool.free_blocks == 0
        assert [c.window for c in reqs[0].caches] == e.windows
        h = e.health()
        assert (h["reserved_blocks"], h["head_needs_blocks"]) == (4 * WINDOWED, 0)
        e._queue.extend(_requests(1))
        e._admit()                        # the fifth waits: the pool is full
        assert len(e._running) == 4 and e.health()["head_needs_blocks"] == WINDOWED
        e._queue.clear()
        for r in reqs:
            e._retire(r, publish=False)
    assert e.pool.free_blocks == e.pool.total_blocks
    e.pool.check()


def test_never_fits_and_max_positions_count_the_windows(parts):
    from ferrox_kv.serve.engine import NeverFits, Request, Sampling

    on, off = _engine(parts, 2 * WHOLE), _engine(parts, 2 * WHOLE, sliding_windows=False)
    # 120 blocks: whole, 20 per layer (80 positions); windowed, the full layer
    # takes what the five windows (20 blocks) leave: 100 blocks, 400 positions
    assert (on.max_positions, off.max_positions) == (400, 80)
    on.check_fits(Request(list(range(3, 103)), 300, Sampling(0)))
    r = Request(list(range(3, 103)), 301, Sampling(0))            # 101 + 5 x 4 blocks
    with pytest.raises(NeverFits, match="121 blocks over 6 layers \\(5 sliding"):
        on.check_fits(r)
    with pytest.raises(NeverFits, match="over 6 layers; the whole pool"):
        off.check_fits(r)


def test_the_cli_stores_sliding_layers_whole_on_request():
    import argparse

    from ferrox_kv.serve.cli import add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert ap.parse_args(["m"]).no_sliding_windows is False
    assert ap.parse_args(["m", "--no-sliding-windows"]).no_sliding_windows is True
