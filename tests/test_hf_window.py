"""Sliding-window layers in FerroxCache: token-identical to DynamicCache in
float32 on tiny random Gemma 3, Qwen2 (use_sliding_window) and gpt-oss
models, and the pool holds only what the windows need (measured)."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from ferrox_kv import KvBlockPool, KvPoolExhausted  # noqa: E402
from ferrox_kv.hf import FerroxCache, kv_geometry, layer_windows  # noqa: E402
from support.models import VOCAB  # noqa: E402
from support.models import prompt as _prompt  # noqa: E402

COMMON = dict(vocab_size=VOCAB, intermediate_size=64, max_position_embeddings=512)


def _family(name):
    t = transformers
    if name == "gemma3":      # five sliding layers of six
        return t.Gemma3ForCausalLM(t.Gemma3TextConfig(
            hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, sliding_window=8, **COMMON)), ("sdpa", "ferrox")
    if name == "qwen2":       # sliding from layer 1 on
        return t.Qwen2ForCausalLM(t.Qwen2Config(
            hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3,
            use_sliding_window=True, sliding_window=8, max_window_layers=1, **COMMON)), (
            "sdpa", "ferrox")
    # gpt-oss runs eager only (its attention sinks): every other layer sliding
    return t.GptOssForCausalLM(t.GptOssConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
        **COMMON)), ("eager",)


@pytest.fixture(scope="module", params=["gemma3", "qwen2", "gpt-oss"])
def family(request):
    torch.manual_seed(1234)
    m, impls = _family(request.param)
    m.eval()
    m.generation_config.pad_token_id = 0
    return m, impls


def _gen(model, ids, cache, impl, **kw):
    kw.setdefault("max_new_tokens", 30)
    kw.setdefault("do_sample", False)
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(ids, cache=cache, **kw)


def _reference(model, impls, ids, **kw):
    return _gen(model, ids, DynamicCache(config=model.config), impls[0], **kw)


def test_the_config_marks_the_sliding_layers(family):
    m, _ = family
    ws = layer_windows(m.config)
    assert 8 in ws and None in ws
    cache = FerroxCache(m.config)
    assert [layer.sliding_window for layer in cache.layers] == ws
    assert [c.window for layer in cache.layers for c in layer.seqs] == ws
    assert all(c.window is None for layer in FerroxCache(m.config, sliding_windows=False).layers
               for c in layer.seqs)


@pytest.mark.parametrize("pooled", [False, True])
def test_greedy_tokens_equal_dynamic_cache_and_windows_give_blocks_back(family, pooled):
    m, impls = family
    ids = _prompt(12, seed=3)
    ref = _reference(m, impls, ids)
    _, h, d = kv_geometry(m.config)
    for impl in impls:
        pool = KvBlockPool(4, 512, h, d) if pooled else None
        cache = FerroxCache(m.config, pool=pool, max_seq_len=42 if pooled else None)
        got = _gen(m, ids, cache, impl)
        assert torch.equal(ref, got), impl
        for layer in cache.layers:
            for c in layer.seqs:
                if layer.is_sliding:
                    assert c.first_pos > 0 and c.seq_len == 41
        if pooled:
            pool.check()
            cache.close()
            assert pool.free_blocks == 512


def test_beam_search_and_a_padded_batch_equal_dynamic_cache(family):
    m, impls = family
    ids = _prompt(9, seed=10)
    kw = dict(num_beams=3, max_new_tokens=20, early_stopping=True)
    _, h, d = kv_geometry(m.config)
    ref = _reference(m, impls, ids, **kw)
    pool = KvBlockPool(4, 1024, h, d)
    for impl in impls:
        assert torch.equal(ref, _gen(m, ids, FerroxCache(m.config, pool=pool, max_seq_len=30),
                                     impl, **kw))
        pool.check()
    batch = _prompt(14, seed=12, batch=2)
    mask = torch.ones_like(batch)
    mask[1, :5] = 0
    batch[1, :5] = 0
    ref = _reference(m, impls, batch, attention_mask=mask)
    for impl in impls:
        assert torch.equal(ref, _gen(m, batch, FerroxCache(m.config), impl, attention_mask=mask))


def test_assisted_decoding_rolls_back_within_the_window(family):
    m, impls = family
    ids = _prompt(12, seed=5)
    ids = torch.cat([ids, ids[:, :6], ids, ids[:, 3:9]], dim=1)    # repeats for prompt lookup
    kw = dict(prompt_lookup_num_tokens=4, max_new_tokens=25)
    ref = _reference(m, impls, ids, max_new_tokens=25)
    for impl in impls:
        assert torch.equal(ref, _gen(m, ids, FerroxCache(m.config), impl, **kw))


@pytest.mark.long
def test_windowed_layers_hold_a_fraction_of_the_bytes_measured(family):
    """8 + 120 positions with a window of 8: the pool's used blocks, measured,
    against the same cache with the sliding layers stored whole."""
    m, impls = family
    ids = _prompt(8, seed=7)
    _, h, d = kv_geometry(m.config)
    held = {}
    for whole in (False, True):
        pool = KvBlockPool(4, 4096, h, d)
        cache = FerroxCache(m.config, pool=pool, max_seq_len=128, sliding_windows=not whole)
        _gen(m, ids, cache, impls[0], max_new_tokens=120, min_new_tokens=120)
        held[whole] = pool.used_blocks * pool.block_bytes
        cache.close()
    ws = layer_windows(m.config)
    full = sum(w is None for w in ws)
    # each sliding layer keeps ceil((8 + 4 - 1) / 4) + 1 = 4 blocks of the 32 a whole one holds
    assert held[True] == len(ws) * 32 * pool.block_bytes
    assert held[False] == (full * 32 + (len(ws) - full) * 4) * pool.block_bytes


def test_layers_of_several_windows_are_reserved_in_one_acquisition(family):
    """Full and sliding layers (and a batch of them) in one all-or-nothing
    acquisition: a pool one block short refuses once and is left as it was;
    one that fits gives each layer its own need."""
    m, _ = family
    _, h, d = kv_geometry(m.config)
    ws = layer_windows(m.config)
    need = sum(10 if w is None else -(-(w + 4 - 1) // 4) + 1 for w in ws)   # 40 positions
    short = KvBlockPool(4, 2 * need - 1, h, d)
    before = short.stats()
    with pytest.raises(KvPoolExhausted) as e:
        FerroxCache(m.config, pool=short, max_seq_len=40, batch_size=2)
    assert e.value.requested == 2 * need
    after = short.stats()
    assert after.pop("refused") == before.pop("refused") + 1 and after == before
    short.check()
    pool = KvBlockPool(4, 2 * need, h, d)
    cache = FerroxCache(m.config, pool=pool, max_seq_len=40, batch_size=2)
    assert pool.free_blocks == 0 and pool.stats()["acquired"] == 2 * need
    assert [[c.window for c in layer.seqs] for layer in cache.layers] == [[w, w] for w in ws]
    cache.close()
    assert pool.free_blocks == 2 * need
    pool.check()
