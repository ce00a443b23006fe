"""FerroxCache in transformers' generate: token-identical to DynamicCache.

Tiny randomly initialised models built from configs (no downloads). torch and
transformers are installed by .ci/run, so these run in CI."""
import gc

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from ferrox_kv import KvBlockPool, KvPoolExhausted  # noqa: E402
from ferrox_kv.hf import FerroxCache, FerroxLayer, kv_geometry, layer_windows  # noqa: E402
from support.models import VOCAB, config  # noqa: E402
from support.models import prompt as _prompt  # noqa: E402



@pytest.fixture(scope="module", params=["llama-sdpa", "llama-ferrox", "qwen2-ferrox",
                                        "mistral-ferrox"])
def model(request):
    """A tiny random model; "-ferrox" ones read FerroxCache in place, the
    "-sdpa" one gets the K/V handed over (the gathering path any other
    attention implementation takes). References always run DynamicCache with
    SDPA on the same weights."""
    name, impl = request.param.split("-")
    cfg, cls = config(name)
    torch.manual_seed(1234)
    m = cls(cfg).eval()
    m.generation_config.pad_token_id = 0
    m.set_attn_implementation(impl)
    return m


class _impl:
    """Run a block with another attention implementation."""

    def __init__(self, model, impl):
        self.model, self.impl = model, impl

    def __enter__(self):
        self.old = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.impl)

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.old)


def _reference(model, ids, cache=None, **kw):
    """generate with DynamicCache (or ``cache``) and SDPA: what FerroxCache
    must match."""
    with _impl(model, "sdpa"):
        return _gen(model, ids, cache if cache is not None else DynamicCache(config=model.config), **kw)


def _pool_for(model, blocks, block_size=8):
    _, h, d = kv_geometry(model.config)
    return KvBlockPool(block_size, blocks, h, d)


def _plan(model, max_seq_len, block_size=8):
    """Blocks one sequence of ``model`` reserves: ceil(max_seq_len / block_size)
    per full layer; a sliding layer at most what its window needs
    (``KvCache.with_pool`` with ``window=``, ``max_chunk`` = block_size)."""
    per = -(-max_seq_len // block_size)
    return sum(per if w is None else min(per, -(-(w + block_size - 1) // block_size) + 1)
               for w in layer_windows(model.config))


def _gen(model, ids, cache, **kw):
    kw.setdefault("max_new_tokens", 40)
    kw.setdefault("do_sample", False)
    with torch.no_grad():
        return model.generate(ids, cache=cache, **kw)


def test_geometry_is_read_from_the_config(model):
    layers, h, d = kv_geometry(model.config)
    assert layers == model.config.num_hidden_layers
    assert h == model.config.num_key_value_heads
    assert d == model.config.hidden_size // model.config.num_attention_heads


def test_greedy_generation_is_token_identical_to_dynamic_cache(model):
    ids = _prompt()
    ref = _reference(model, ids)
    got = _gen(model, ids, FerroxCache(model.config))
    assert ref.shape[1] == ids.shape[1] + 40
    assert torch.equal(ref, got)


def test_returned_keys_are_zero_copy_views_of_contiguous_caches(model):
    cache = FerroxCache(model.config, max_seq_len=64)
    _gen(model, _prompt(), cache, max_new_tokens=3)
    layer = cache.layers[0]
    keys, values = layer._gather()
    # a sliding layer hands over its window: the rows from the last step's offset
    kview = layer.seqs[0].k[layer._offset - layer.seqs[0].first_pos:]
    assert keys.shape == (1, kview.shape[1], kview.shape[0], kview.shape[2])
    assert keys.data_ptr() == kview.__array_interface__["data"][0]
    assert torch.equal(keys[0].permute(1, 0, 2), torch.from_numpy(kview.copy()))


def test_pooled_generation_is_identical_and_every_block_comes_back(model):
    ids = _prompt()
    ref = _reference(model, ids)
    pool = _pool_for(model, 64)
    with FerroxCache(model.config, pool=pool, max_seq_len=52) as cache:
        assert pool.used_blocks == _plan(model, 52) == cache.blocks_held     # ceil(52 / 8) per full layer
        got = _gen(model, ids, cache)
        assert pool.used_blocks == _plan(model, 52)                          # never grew
    assert torch.equal(ref, got)
    assert pool.free_blocks == 64
    s = pool.stats()
    assert s["acquired"] == s["released"]
    assert s["high_water"] == _plan(model, 52)                     # never past the reservation
    if all(w is None for w in layer_windows(model.config)):
        assert s["acquired"] == _plan(model, 52)   # (sliding layers recycle their blocks)


def test_pooled_cache_gives_blocks_back_when_garbage_collected(model):
    pool = _pool_for(model, 64)
    cache = FerroxCache(model.config, pool=pool, max_seq_len=40)
    _gen(model, _prompt(), cache, max_new_tokens=5)
    assert pool.free_blocks < 64
    del cache
    gc.collect()
    assert pool.free_blocks == 64


def test_admission_is_refused_with_the_pool_untouched_when_one_block_short(model):
    pool = _pool_for(model, _plan(model, 52) - 1)
    before = pool.stats()
    with pytest.raises(KvPoolExhausted) as ei:
        FerroxCache(model.config, pool=pool, max_seq_len=52)
    assert ei.value.requested == _plan(model, 52) and ei.value.free == _plan(model, 52) - 1
    after = pool.stats()
    assert after["free_blocks"] == before["free_blocks"] == _plan(model, 52) - 1
    assert after["acquired"] == before["acquired"] == 0
    pool2 = _pool_for(model, _plan(model, 52))
    FerroxCache(model.config, pool=pool2, max_seq_len=52).close()    # exactly enough


def test_pool_with_the_wrong_geometry_is_refused(model):
    _, h, d = kv_geometry(model.config)
    with pytest.raises(ValueError, match="geometry"):
        FerroxCache(model.config, pool=KvBlockPool(8, 8, h, d + 1), max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len is required"):
        FerroxCache(model.config, pool=KvBlockPool(8, 8, h, d))


def test_prompt_lookup_decoding_is_identical_and_rolls_back(model, monkeypatch):
    # a repetitive prompt, so prompt lookup finds drafts; a random model rejects most
    base = _prompt(6, seed=3)
    ids = torch.cat([base, base, base, base[:, :3]], dim=1)
    ref = _reference(model, ids, max_new_tokens=30)
    removed = []
    orig = FerroxLayer.crop

    def spy(self, n):
        before = self.get_seq_length()
        orig(self, n)
        removed.append(before - self.get_seq_length())

    monkeypatch.setattr(FerroxLayer, "crop", spy)
    pool = _pool_for(model, 128)
    with FerroxCache(model.config, pool=pool, max_seq_len=ids.shape[1] + 40) as cache:
        got = _gen(model, ids, cache, max_new_tokens=30, prompt_lookup_num_tokens=4)
    assert torch.equal(ref, got)
    assert sum(removed) > 0, "no draft was ever rolled back"
    assert pool.free_blocks == 128


def test_assisted_decoding_with_a_draft_model_is_identical(model):
    ids = _prompt(10, seed=4)
    ref = _reference(model, ids, max_new_tokens=20)
    d = model.config.to_dict()
    d.pop("layer_types", None)
    cfg = model.config.__class__(**{**d, "num_hidden_layers": 1})
    torch.manual_seed(7)
    draft = model.__class__(cfg).eval()
    draft.generation_config.pad_token_id = 0
    got = _gen(model, ids, FerroxCache(model.config), max_new_tokens=20, assistant_model=draft)
    assert torch.equal(ref, got)


def test_multi_turn_continuation_with_the_same_cache_is_identical(model):
    turn1 = _prompt(10, seed=5)
    user2 = _prompt(5, seed=6)
    ref_cache, fx_cache = DynamicCache(config=model.config), FerroxCache(model.config)
    ref1 = _reference(model, turn1, ref_cache, max_new_tokens=15)
    got1 = _gen(model, turn1, fx_cache, max_new_tokens=15)
    assert torch.equal(ref1, got1)
    ref2 = _reference(model, torch.cat([ref1, user2], 1), ref_cache, max_new_tokens=15)
    got2 = _gen(model, torch.cat([got1, user2], 1), fx_cache, max_new_tokens=15)
    assert torch.equal(ref2, got2)
    assert fx_cache.get_seq_length() == ref_cache.get_seq_length()


def test_left_padded_batch_of_two_is_identical(model):
    a, b = _prompt(12, seed=8), _prompt(7, seed=9)
    ids = torch.zeros((2, 12), dtype=torch.long)
    mask = torch.zeros((2, 12), dtype=torch.long)
    ids[0], mask[0] = a[0], 1
    ids[1, 5:], mask[1, 5:] = b[0], 1
    ref = _reference(model, ids, attention_mask=mask, max_new_tokens=25)
    pool = _pool_for(model, 64)
    with FerroxCache(model.config, pool=pool, max_seq_len=40, batch_size=2) as cache:
        got = _gen(model, ids, cache, attention_mask=mask, max_new_tokens=25)
        assert cache.batch_size == 2
    assert torch.equal(ref, got)
    assert pool.free_blocks == 64


def test_beam_search_with_three_beams_is_identical(model):
    ids = _prompt(9, seed=10)
    kw = dict(num_beams=3, max_new_tokens=20, early_stopping=True)
    ref = _reference(model, ids, **kw)
    pool = _pool_for(model, 256)
    with FerroxCache(model.config, pool=pool, max_seq_len=30) as cache:
        got = _gen(model, ids, cache, **kw)
        assert cache.batch_size == 3                          # reserved on the way
        assert cache.blocks_held == 3 * _plan(model, 30)             # every beam holds its plan
        assert pool.used_blocks < 3 * _plan(model, 30)               # the common blocks once
    assert torch.equal(ref, got)
    assert pool.free_blocks == 256


def test_beam_search_refuses_when_the_extra_beams_do_not_fit(model):
    pool = _pool_for(model, 2 * _plan(model, 30))                 # room for 2 of the 3 beams
    cache = FerroxCache(model.config, pool=pool, max_seq_len=30)
    with pytest.raises(KvPoolExhausted):
        _gen(model, _prompt(9, seed=10), cache, num_beams=3, max_new_tokens=5)
    assert pool.used_blocks == _plan(model, 30) and cache.batch_size == 1     # unchanged
    cache.close()
    assert pool.free_blocks == pool.total_blocks


def test_sampling_is_identical_under_the_same_seed(model):
    ids = _prompt(8, seed=11)
    kw = dict(do_sample=True, top_k=20, temperature=0.9, max_new_tokens=30)
    torch.manual_seed(99)
    ref = _reference(model, ids, **kw)
    torch.manual_seed(99)
    got = _gen(model, ids, FerroxCache(model.config, max_seq_len=64), **kw)
    assert torch.equal(ref, got)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_deprecated_past_key_values_argument_works(model):
    ids = _prompt(8, seed=12)
    ref = _reference(model, ids, max_new_tokens=10)
    cache = FerroxCache(model.config)
    with torch.no_grad():
        got = model.generate(ids, past_key_values=cache, max_new_tokens=10, do_sample=False)
    assert torch.equal(ref, got)
    assert cache.get_seq_length() == ids.shape[1] + 9


def test_reset_empties_every_layer_but_keeps_the_reservation(model):
    pool = _pool_for(model, 64)
    cache = FerroxCache(model.config, pool=pool, max_seq_len=30)
    ids = _prompt(8, seed=13)
    first = _gen(model, ids, cache, max_new_tokens=10)
    held = pool.used_blocks
    cache.reset()
    assert cache.get_seq_length() == 0 and pool.used_blocks == held
    again = _gen(model, ids, cache, max_new_tokens=10)
    assert torch.equal(first, again)
    cache.close()
    assert pool.free_blocks == 64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_are_identical_through_conversion(model, dtype):
    half = model.to(dtype)
    try:
        ids = _prompt(10, seed=14)
        ref = _reference(half, ids, max_new_tokens=20)
        got = _gen(half, ids, FerroxCache(half.config), max_new_tokens=20)
        assert torch.equal(ref, got)
    finally:
        model.to(torch.float32)


def _prefilled(cache, model, ids):
    """A forward pass with SDPA, so that FerroxCache and DynamicCache hold
    bit-identical K/V (what these tests compare)."""
    with torch.no_grad(), _impl(model, "sdpa"):
        model(input_ids=ids, cache=cache, use_cache=True)
    return cache


def _layer_kv(cache, i):
    layer = cache.layers[i]
    if isinstance(layer, FerroxLayer):
        return layer._gather()
    return layer.keys, layer.values


def test_batch_repeat_interleave_and_select_indices_match_dynamic_cache(model):
    ids = _prompt(7, seed=15, batch=2)
    pool = _pool_for(model, 128)
    ref = _prefilled(DynamicCache(config=model.config), model, ids)
    fx = _prefilled(FerroxCache(model.config, pool=pool, max_seq_len=16, batch_size=2), model, ids)
    layers = model.config.num_hidden_layers
    for step in [lambda c: c.batch_repeat_interleave(3),
                 lambda c: c.batch_select_indices(torch.tensor([5, 0, 3]))]:
        step(ref)
        step(fx)
        for i in range(layers):
            rk, rv = _layer_kv(ref, i)
            fk, fv = _layer_kv(fx, i)
            assert torch.equal(rk, fk) and torch.equal(rv, fv)
    assert fx.batch_size == 3 and pool.used_blocks == 3 * layers * 2
    fx.close()
    assert pool.free_blocks == 128


def test_batch_repeat_interleave_refuses_with_nothing_changed_when_the_pool_is_short(model):
    layers = model.config.num_hidden_layers
    pool = _pool_for(model, 3 * layers * 2)            # room for 3 sequences, not 4
    fx = _prefilled(FerroxCache(model.config, pool=pool, max_seq_len=16, batch_size=2),
                    model, _prompt(7, seed=16, batch=2))
    before = [(_layer_kv(fx, i)[0].clone()) for i in range(layers)]
    with pytest.raises(KvPoolExhausted):
        fx.batch_repeat_interleave(2)
    assert fx.batch_size == 2 and pool.used_blocks == 2 * layers * 2
    assert all(torch.equal(before[i], _layer_kv(fx, i)[0]) for i in range(layers))
    fx.close()


def test_models_with_non_attention_layers_are_refused():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)
    cfg.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="linear_attention"):
        FerroxCache(cfg)


def test_bad_arguments_are_refused_with_the_pool_untouched(model):
    pool = _pool_for(model, 64)
    with pytest.raises(ValueError, match="batch_size"):
        FerroxCache(model.config, pool=pool, max_seq_len=8, batch_size=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        FerroxCache(model.config, pool=pool, max_seq_len=-1)
    assert pool.free_blocks == 64 and pool.stats()["acquired"] == 0
    cache = _prefilled(FerroxCache(model.config, pool=pool, max_seq_len=16, batch_size=2),
                       model, _prompt(5, seed=17, batch=2))
    held = pool.used_blocks
    before = _layer_kv(cache, 0)[0].clone()
    with pytest.raises(IndexError, match="out of range"):
        cache.batch_select_indices(torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="entries"):
        cache.layers[0].reorder_cache(torch.tensor([0, 1, 1]))
    assert pool.used_blocks == held and cache.batch_size == 2
    assert torch.equal(before, _layer_kv(cache, 0)[0])
    cache.close()
    assert pool.free_blocks == 64


def test_a_smaller_batch_than_the_cache_holds_is_refused_with_nothing_changed(model):
    pool = _pool_for(model, 64)
    cache = _prefilled(FerroxCache(model.config, pool=pool, max_seq_len=16, batch_size=2),
                       model, _prompt(5, seed=18, batch=2))
    held, length = pool.used_blocks, cache.get_seq_length()
    with pytest.raises(ValueError, match="batch of 1"):
        _prefilled(cache, model, _prompt(1, seed=19, batch=1))
    assert pool.used_blocks == held and cache.get_seq_length() == length
    cache.close()


def _one_layer_cache(pool, batch, max_seq_len):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1)
    return FerroxCache(cfg, pool=pool, max_seq_len=max_seq_len, batch_size=batch)


def test_update_is_all_or_nothing_across_the_batch():
    pool = KvBlockPool(4, 3, 1, 8)                 # 2 reserved, 1 free
    cache = _one_layer_cache(pool, 2, 4)
    layer = cache.layers[0]
    layer.update(torch.ones(2, 1, 4, 8), torch.ones(2, 1, 4, 8))
    assert [c.seq_len for c in layer.seqs] == [4, 4]
    with pytest.raises(KvPoolExhausted) as e:      # each sequence needs a block: 2 > 1
        layer.update(torch.ones(2, 1, 1, 8), torch.ones(2, 1, 1, 8))
    assert (e.value.requested, e.value.free) == (2, 1)
    assert [c.seq_len for c in layer.seqs] == [4, 4]
    assert pool.free_blocks == 1


def test_update_with_mismatched_key_and_value_batches_names_the_mismatch():
    pool = KvBlockPool(4, 8, 1, 8)
    cache = _one_layer_cache(pool, 2, 4)
    layer = cache.layers[0]
    before = pool.stats()
    with pytest.raises(ValueError, match=r"key_states \(2, 1, 1, 8\) and value_states \(1, 1, 1, 8\)"):
        layer.update(torch.ones(2, 1, 1, 8), torch.ones(1, 1, 1, 8))
    with pytest.raises(ValueError, match="this cache holds 1 heads of 8"):
        layer.update(torch.ones(2, 2, 1, 8), torch.ones(2, 2, 1, 8))
    assert [c.seq_len for c in layer.seqs] == [0, 0] and pool.stats() == before


def test_a_batch_that_grows_in_update_shrinks_back_when_the_write_is_refused():
    pool = KvBlockPool(4, 3, 1, 8)
    cache = _one_layer_cache(pool, 1, 8)           # 2 blocks reserved, 1 free
    layer = cache.layers[0]
    with pytest.raises(KvPoolExhausted):
        layer.update(torch.ones(3, 1, 2, 8), torch.ones(3, 1, 2, 8))
    assert cache.batch_size == 1 and layer.seqs[0].seq_len == 0 and pool.free_blocks == 1


def test_reorder_cache_moves_every_layer_at_once_and_shares_blocks(model):
    layers = model.config.num_hidden_layers
    pool = _pool_for(model, 64, block_size=4)
    cache = FerroxCache(model.config, pool=pool, max_seq_len=12, batch_size=3)
    _, h, d = kv_geometry(model.config)
    for li, layer in enumerate(cache.layers):
        k = torch.arange(3 * h * 6 * d, dtype=torch.float32).reshape(3, h, 6, d) + li
        layer.update(k, -k)
    before = {li: [c.k.copy() for c in layer.seqs] for li, layer in enumerate(cache.layers)}
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    for li, layer in enumerate(cache.layers):
        for b, src in enumerate([2, 2, 0]):
            assert torch.equal(torch.from_numpy(layer.seqs[b].k), torch.from_numpy(before[li][src]))
        t = [c.block_table.tolist() for c in layer.seqs]
        assert t[0][0] == t[1][0]                     # the shared full block
    # each sequence holds its 3-block plan; the full first block of source 2 is held once
    assert cache.blocks_held == 3 * layers * 3
    assert pool.used_blocks == layers * (3 * 3 - 1)
    cache.close()
    assert pool.free_blocks == 64
    with pytest.raises(ValueError, match="FerroxCache is closed"):
        cache.reorder_cache(torch.tensor([0, 1, 2]))


# -- the "ferrox" attention implementation ----------------------------------------

@pytest.fixture(scope="module")
def ferrox_llama():
    cfg, cls = config("llama")
    torch.manual_seed(4321)
    m = cls(cfg).eval()
    m.generation_config.pad_token_id = 0
    m.set_attn_implementation("ferrox")
    return m


def _counting_attend(monkeypatch):
    import ferrox_kv.hf.attention as fhf
    calls = []
    real = fhf.attend_many

    def counted(caches, q, **kw):
        calls.append(q.shape)
        return real(caches, q, **kw)

    monkeypatch.setattr(fhf, "attend_many", counted)
    monkeypatch.setattr(FerroxLayer, "_gather", lambda self: pytest.fail("ferrox attention gathered"))
    return calls


@pytest.mark.parametrize("prompt_len", [12, 40])      # a short prefill attends, a long one uses SDPA
def test_ferrox_attention_reads_the_pool_in_place_and_never_gathers(ferrox_llama, monkeypatch,
                                                                     prompt_len):
    import ferrox_kv.hf.attention as fhf
    monkeypatch.setattr(fhf, "SDPA_PREFILL_MIN", 32)
    ids = _prompt(prompt_len, seed=30)
    ref = _reference(ferrox_llama, ids, max_new_tokens=20)
    calls = _counting_attend(monkeypatch)
    pool = _pool_for(ferrox_llama, 128)
    with FerroxCache(ferrox_llama.config, pool=pool, max_seq_len=prompt_len + 20) as cache:
        got = _gen(ferrox_llama, ids, cache, max_new_tokens=20)
    assert torch.equal(ref, got)
    layers = ferrox_llama.config.num_hidden_layers
    decode = [s for s in calls if s[1] == 1]
    assert len(decode) == 19 * layers                      # every decode step of every layer
    assert len(calls) == (19 + (prompt_len < 32)) * layers
    assert pool.free_blocks == 128


def test_ferrox_attention_on_a_left_padded_batch_never_attends_padding(ferrox_llama, monkeypatch):
    a, b = _prompt(14, seed=31), _prompt(6, seed=32)
    ids = torch.zeros((2, 14), dtype=torch.long)
    mask = torch.zeros((2, 14), dtype=torch.long)
    ids[0], mask[0] = a[0], 1
    ids[1, 8:], mask[1, 8:] = b[0], 1
    ids[1, :8] = 77                                       # padding that would change the result
    ref = _reference(ferrox_llama, ids, attention_mask=mask, max_new_tokens=15)
    calls = _counting_attend(monkeypatch)
    with FerroxCache(ferrox_llama.config, pool=_pool_for(ferrox_llama, 64), max_seq_len=29,
                     batch_size=2) as cache:
        got = _gen(ferrox_llama, ids, cache, attention_mask=mask, max_new_tokens=15)
    assert torch.equal(ref, got) and calls


def test_logits_stay_within_1e4_of_dynamic_cache_at_every_step(model):
    ids = _prompt(20, seed=33)
    kw = dict(max_new_tokens=25, output_logits=True, return_dict_in_generate=True)
    ref = _reference(model, ids, **kw)
    pool = _pool_for(model, 64)
    with FerroxCache(model.config, pool=pool, max_seq_len=45) as cache:
        got = _gen(model, ids, cache, **kw)
    assert torch.equal(ref.sequences, got.sequences)
    for r, g in zip(ref.logits, got.logits):
        assert (g - r).abs().max() <= 1e-4 * r.abs().max()


def test_the_ferrox_attention_falls_back_to_sdpa_without_a_ferrox_cache(ferrox_llama):
    ids = _prompt(10, seed=34)
    with torch.no_grad():
        with _impl(ferrox_llama, "sdpa"):
            ref = ferrox_llama(input_ids=ids, use_cache=False).logits
        got = ferrox_llama(input_ids=ids, use_cache=False).logits       # no cache at all
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    ref_ids = _reference(ferrox_llama, ids, max_new_tokens=15)
    got_ids = _gen(ferrox_llama, ids, DynamicCache(config=ferrox_llama.config), max_new_tokens=15)
    assert torch.equal(ref_ids, got_ids)                  # a DynamicCache on a ferrox model


def test_other_attention_implementations_warn_once_naming_the_fast_path(monkeypatch):
    import ferrox_kv.hf.cache as fhf
    monkeypatch.setattr(fhf, "_warned", False)
    cfg, cls = config("llama")
    m = cls(cfg).eval()
    m.set_attn_implementation("sdpa")
    with pytest.warns(UserWarning, match=r"set_attn_implementation\('ferrox'\)"):
        _gen(m, _prompt(5), FerroxCache(cfg), max_new_tokens=3)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _gen(m, _prompt(5), FerroxCache(cfg), max_new_tokens=3)     # once per process


# -- prefix reuse --------------------------------------------------------------------

def _prefix_pool(model, blocks=256, block_size=4):
    _, h, d = kv_geometry(model.config)
    return KvBlockPool(block_size, blocks, h, d, prefix_cache=True)


def test_a_chat_reuses_its_history_prefills_only_the_rest_and_is_identical(model, monkeypatch):
    pool = _prefix_pool(model)
    history = _prompt(13, seed=40)
    fed = []
    orig = FerroxLayer.update

    def spy(self, k, v, *a, **kw):
        if self.layer_idx == 0:
            fed.append(k.shape[2])
        return orig(self, k, v, *a, **kw)

    monkeypatch.setattr(FerroxLayer, "update", spy)
    kw = dict(max_new_tokens=8, output_logits=True, return_dict_in_generate=True)
    published = 0
    for turn in range(3):
        ref = _reference(model, history, **kw)                  # from scratch, no reuse
        with FerroxCache(model.config, pool=pool, max_seq_len=history.shape[1] + 8,
                         tokens=history[0], sliding_windows=False) as cache:
            reused = cache.get_seq_length()
            assert reused == min(published, (history.shape[1] - 1) // 4 * 4) and (reused or not turn)
            fed.clear()
            got = _gen(model, history, cache, **kw)
            assert fed[0] == history.shape[1] - reused          # only the rest was prefilled
            assert torch.equal(ref.sequences, got.sequences)
            for r, g in zip(ref.logits, got.logits):
                assert (g - r).abs().max() <= 1e-4 * r.abs().max()
            published = cache.publish(got.sequences[0])
        history = torch.cat([got.sequences, _prompt(5, seed=41 + turn)], dim=1)
    s = pool.stats()
    assert s["prefix_hits"] == 2 and s["prefix_misses"] == 1 and s["used_blocks"] == 0
    assert s["cached_blocks"] > 0
    pool.check()


def test_prefix_reuse_with_sliding_windows_is_refused_by_name(model):
    """Windowed caches take no part in the prefix cache (issue 26, option
    (a)): a model with a sliding layer reuses prefixes only when its sliding
    layers are stored whole."""
    pool = _prefix_pool(model)
    before = pool.stats()
    if any(w is not None for w in layer_windows(model.config)):
        with pytest.raises(ValueError, match="sliding-window layers.*sliding_windows=False"):
            FerroxCache(model.config, pool=pool, max_seq_len=16, tokens=[1, 2, 3])
        assert pool.stats() == before
    else:
        FerroxCache(model.config, pool=pool, max_seq_len=16, tokens=[1, 2, 3]).close()
    pool.check()


def test_a_prompt_shorter_than_a_block_counts_as_a_prefix_miss(ferrox_llama):
    pool = _prefix_pool(ferrox_llama, block_size=4)
    for prompt in ([1, 2, 3], [1, 2, 3, 4]):               # no whole block to reuse
        with FerroxCache(ferrox_llama.config, pool=pool, max_seq_len=8, tokens=prompt) as cache:
            _gen(ferrox_llama, torch.tensor([prompt]), cache, max_new_tokens=2)
    s = pool.stats()
    assert (s["prefix_hits"], s["prefix_misses"]) == (0, 2)
    pool.check()


def test_prefix_reuse_arguments_are_checked(model):
    pool = _prefix_pool(model)
    with pytest.raises(ValueError, match="batch of 1"):
        FerroxCache(model.config, pool=pool, max_seq_len=16, batch_size=2, tokens=[1, 2, 3],
                    sliding_windows=False)
    with pytest.raises(ValueError, match="prefix_cache=True"):
        FerroxCache(model.config, pool=_pool_for(model, 64), max_seq_len=16, tokens=[1, 2, 3],
                    sliding_windows=False)
    with pytest.raises(ValueError, match="needs a pool"):
        FerroxCache(model.config, max_seq_len=16, tokens=[1, 2, 3], sliding_windows=False)
    cache = FerroxCache(model.config, pool=pool, max_seq_len=16, tokens=[1, 2, 3],
                        sliding_windows=False)
    _gen(model, torch.tensor([[1, 2, 3]]), cache, max_new_tokens=2)
    with pytest.raises(ValueError, match="4 positions"):
        cache.publish([1, 2])
    assert cache.publish([1, 2, 3, 5]) == 4
    cache.close()
    with pytest.raises(ValueError, match="closed"):
        cache.publish([1, 2, 3, 5])
    pool.check()
    assert pool.used_blocks == 0


def test_with_dropout_the_ferrox_attention_falls_back_on_the_real_keys(ferrox_llama):
    ids = _prompt(10, seed=50)
    ferrox_llama.train()
    ferrox_llama.config.attention_dropout = 0.3
    for m in ferrox_llama.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.3
    try:
        with torch.no_grad():
            torch.manual_seed(3)
            with _impl(ferrox_llama, "sdpa"):
                ref_cache = DynamicCache(config=ferrox_llama.config)
                ferrox_llama(input_ids=ids, cache=ref_cache, use_cache=True)
                ref = ferrox_llama(input_ids=ids[:, :1], cache=ref_cache, use_cache=True).logits
            torch.manual_seed(3)
            cache = FerroxCache(ferrox_llama.config, pool=_pool_for(ferrox_llama, 64),
                                max_seq_len=16)
            ferrox_llama(input_ids=ids, cache=cache, use_cache=True)
            got = ferrox_llama(input_ids=ids[:, :1], cache=cache, use_cache=True).logits
    finally:
        ferrox_llama.eval()
        ferrox_llama.config.attention_dropout = 0.0
        for m in ferrox_llama.modules():
            if hasattr(m, "attention_dropout"):
                m.attention_dropout = 0.0
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_step_refused_in_a_later_layer_rolls_back_the_earlier_ones(ferrox_llama):
    layers = ferrox_llama.config.num_hidden_layers
    pool = _pool_for(ferrox_llama, layers * 2 + 1, block_size=4)   # one block to spare
    cache = FerroxCache(ferrox_llama.config, pool=pool, max_seq_len=8)
    ids = _prompt(8, seed=51)
    with torch.no_grad():
        ferrox_llama(input_ids=ids, cache=cache, use_cache=True)      # every block full
        with pytest.raises(KvPoolExhausted):                          # layer 0 gets it, 1 not
            ferrox_llama(input_ids=ids[:, :1], cache=cache, use_cache=True)
        assert [layer.get_seq_length() for layer in cache.layers] == [8] * layers
        hog_free = pool.allocate(0)
        assert hog_free.size == 0
        extra = FerroxCache(ferrox_llama.config, pool=_pool_for(ferrox_llama, 64, block_size=4),
                            max_seq_len=9)
        ferrox_llama(input_ids=ids, cache=extra, use_cache=True)
        ref = ferrox_llama(input_ids=ids[:, :1], cache=extra, use_cache=True).logits
    cache.close()
    pool2 = _pool_for(ferrox_llama, 64, block_size=4)
    retry = FerroxCache(ferrox_llama.config, pool=pool2, max_seq_len=9)
    with torch.no_grad():
        ferrox_llama(input_ids=ids, cache=retry, use_cache=True)
        got = ferrox_llama(input_ids=ids[:, :1], cache=retry, use_cache=True).logits
    torch.testing.assert_close(got, ref)


def test_a_dropped_cache_gives_its_blocks_back_without_the_garbage_collector(model):
    pool = _pool_for(model, 64)
    cache = FerroxCache(model.config, pool=pool, max_seq_len=30)
    _gen(model, _prompt(), cache, max_new_tokens=3)
    gc.collect()
    gc.disable()
    try:
        assert pool.free_blocks < 64
        del cache                                  # no reference cycle holds the blocks
        assert pool.free_blocks == 64
    finally:
        gc.enable()


@pytest.mark.parametrize("torch_threads", [1, 2])
def test_the_ferrox_attention_uses_at_most_torchs_thread_count(torch_threads):
    """torch.set_num_threads(k) limits the ferrox attention too (the split
    forced on every call, so any count above one would show); the tokens
    stay DynamicCache's."""
    import ferrox_kv
    from ferrox_kv import _core
    cfg, cls = config("llama")
    torch.manual_seed(1234)
    m = cls(cfg).eval()
    m.generation_config.pad_token_id = 0
    m.set_attn_implementation("ferrox")
    old = (torch.get_num_threads(), ferrox_kv.set_num_threads(3), _core._set_attend_split(0, 1))
    try:
        torch.set_num_threads(torch_threads)
        ids = _prompt()
        ref = _reference(m, ids, max_new_tokens=8)
        got = _gen(m, ids, FerroxCache(m.config), max_new_tokens=8)
        assert _core._attend_threads_used() == torch_threads
        assert torch.equal(ref, got)
    finally:
        torch.set_num_threads(old[0])
        ferrox_kv.set_num_threads(old[1])
        _core._set_attend_split(*old[2])


@pytest.mark.long
def test_torch_compile_fullgraph_is_refused_with_a_clear_error_and_without_it_runs_eagerly(
        ferrox_llama):
    """FerroxCache is no torch custom op: fullgraph tracing stops at the
    first cache call with FerroxCompileError's message (not a trace failing
    deep in dynamo on the C extension); without fullgraph the cache runs
    eagerly between graph breaks and the logits are the uncompiled ones."""
    from ferrox_kv.hf import COMPILE_REFUSED, FerroxCache
    torch._dynamo.reset()
    ids = torch.tensor([[3, 5, 7, 9]])
    full = torch.compile(ferrox_llama.forward, fullgraph=True)
    with torch.no_grad(), pytest.raises(Exception) as err:
        full(input_ids=ids, cache=FerroxCache(ferrox_llama.config), use_cache=True)
    assert "FerroxCache does not run under torch.compile" in str(err.value)
    assert COMPILE_REFUSED.split(":")[0] in str(err.value)
    torch._dynamo.reset()
    broken = torch.compile(ferrox_llama.forward)
    compiled, eager = FerroxCache(ferrox_llama.config), FerroxCache(ferrox_llama.config)
    with torch.no_grad():
        for step in (ids, torch.tensor([[11]])):
            a = broken(input_ids=step, cache=compiled, use_cache=True).logits
            b = ferrox_llama(input_ids=step, cache=eager, use_cache=True).logits
            assert torch.allclose(a, b, atol=1e-5)
    assert compiled.get_seq_length() == eager.get_seq_length() == 5
    assert not FerroxCache(ferrox_llama.config).is_compileable
    torch._dynamo.reset()
