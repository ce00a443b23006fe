"""transformers conformance: FerroxCache where transformers' own caches and
tests expect DynamicCache's behaviour, and the "ferrox" attention where the
cache is not a FerroxCache (it must then be exactly SDPA).

Tiny randomly initialised models built from configs (no downloads)."""
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, QuantizedCache, StaticCache  # noqa: E402

import ferrox_kv.hf.attention as fhf  # noqa: E402
from ferrox_kv import KvBlockPool, KvPoolExhausted  # noqa: E402
from ferrox_kv.hf import FerroxCache, kv_geometry  # noqa: E402
from support.models import VOCAB, config  # noqa: E402



def _build(name):
    cfg, cls = config(name, layers=2)
    torch.manual_seed(99)
    m = cls(cfg).eval()
    m.generation_config.pad_token_id = 0
    return m


@pytest.fixture(scope="module", params=["llama", "mistral"])
def model(request):
    return _build(request.param)


@pytest.fixture(scope="module")
def llama():
    return _build("llama")


def _run(model, impl, fn):
    old = model.config._attn_implementation
    model.set_attn_implementation(impl)
    try:
        with torch.no_grad():
            return fn()
    finally:
        model.set_attn_implementation(old)


def _sdpa_and_ferrox(model, fn):
    return _run(model, "sdpa", fn), _run(model, "ferrox", fn)


def _inputs(padded, n=12, seed=0):
    """A batch of two prompts; ``padded``: the second is left-padded by 5
    (with a token that would change the result if it were attended)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, n), generator=g)
    mask = torch.ones((2, n), dtype=torch.long)
    if padded:
        ids[1, :5], mask[1, :5] = 77, 0
    return ids, mask


def _pool(model, blocks, block_size=8):
    _, h, d = kv_geometry(model.config)
    return KvBlockPool(block_size, blocks, h, d)


def _gen_out(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, **kw)


def _assert_same_generation(ref, got):
    assert torch.equal(ref.sequences, got.sequences)
    for r, g in zip(ref.logits, got.logits):
        assert torch.equal(r, g)


# -- item 9: transformers' own caches under "ferrox" are exactly SDPA --------

@pytest.mark.parametrize("padded", [False, True])
def test_static_cache_prefill_and_decode_logits_are_exactly_sdpa_s(model, padded):
    ids, mask = _inputs(padded)

    def step():
        cache = StaticCache(config=model.config, max_cache_len=24)
        first = model(ids, attention_mask=mask, cache=cache).logits
        nxt = first[:, -1:].argmax(-1)
        mask2 = torch.cat([mask, torch.ones((2, 1), dtype=mask.dtype)], 1)
        return first, model(nxt, attention_mask=mask2, cache=cache).logits

    (ref0, ref1), (got0, got1) = _sdpa_and_ferrox(model, step)
    assert torch.equal(ref0, got0) and torch.equal(ref1, got1)


# StaticCache is also what transformers 5 builds for sliding-window models
# (its SlidingWindowCache is an alias of StaticCache): the "mistral" model runs
# StaticSlidingWindowLayer here.
@pytest.mark.parametrize("padded", [False, True])
def test_generate_with_a_static_cache_is_exactly_sdpa_s(model, padded):
    ids, mask = _inputs(padded, n=14, seed=1)
    ref, got = _sdpa_and_ferrox(model, lambda: _gen_out(
        model, ids, mask, max_new_tokens=10, cache_implementation="static"))
    _assert_same_generation(ref, got)


@pytest.mark.parametrize("padded", [False, True])
def test_generate_with_a_dynamic_cache_is_exactly_sdpa_s(model, padded):
    ids, mask = _inputs(padded, n=14, seed=2)     # longer than mistral's window: kv_offset > 0
    ref, got = _sdpa_and_ferrox(model, lambda: _gen_out(
        model, ids, mask, max_new_tokens=10, cache=DynamicCache(config=model.config)))
    _assert_same_generation(ref, got)


# fp8 is built into transformers; quanto and hqq need their packages
# (optimum-quanto, hqq), which the [test] extra does not install
QUANTIZED = {"fp8": (None, {}),
             "quanto": ("optimum.quanto", {"residual_length": 4, "q_group_size": 16}),
             "hqq": ("hqq", {"residual_length": 4, "q_group_size": 16})}


@pytest.mark.parametrize("backend", list(QUANTIZED))
@pytest.mark.parametrize("padded", [False, True])
def test_generate_with_a_quantized_cache_is_exactly_sdpa_s(llama, backend, padded):
    package, kw = QUANTIZED[backend]
    if package is not None:
        if os.environ.get("FERROX_KV_REQUIRE_INSTALLED"):
            __import__(package)                  # CI installs [quant]: never a silent skip
        else:
            pytest.importorskip(package, reason="pip install '.[quant]'")
    ids, mask = _inputs(padded, seed=3)           # longer than residual_length: quantized rows
    ref, got = _sdpa_and_ferrox(llama, lambda: _gen_out(
        llama, ids, mask, max_new_tokens=10, cache=QuantizedCache(backend, llama.config, **kw)))
    _assert_same_generation(ref, got)


# -- item 8: a custom 4D mask goes to SDPA as given --------------------------

def _custom_masks(n):
    causal = torch.ones(1, 1, n, n, dtype=torch.bool).tril()
    prefix = causal.clone()
    prefix[..., :3, :3] = True                    # a bidirectional prefix: not causal
    additive = torch.zeros(1, 1, n, n).masked_fill(~prefix, float("-inf"))
    return {"causal": causal, "prefix": prefix, "additive": additive}


@pytest.mark.parametrize("kind", ["causal", "prefix", "additive"])
@pytest.mark.parametrize("cache", ["none", "dynamic", "ferrox"])
def test_a_custom_4d_mask_gives_sdpa_s_logits(llama, kind, cache):
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    mask = _custom_masks(6)[kind]

    def fwd():
        kw = {"use_cache": False} if cache == "none" else {
            "use_cache": True,
            "cache": DynamicCache(config=llama.config) if cache == "dynamic" else FerroxCache(llama.config)}
        return llama(ids, attention_mask=mask, **kw).logits

    ref, got = _sdpa_and_ferrox(llama, fwd)
    assert torch.equal(ref, got)
    if kind != "causal":                          # the mask was applied, not a causal one
        plain = _run(llama, "sdpa", lambda: llama(ids, use_cache=False).logits)
        assert not torch.allclose(plain, got)


# -- item 7: batch_select_indices as DynamicCache ----------------------------

def _prefilled_pair(model, pool):
    ids = torch.randint(1, VOCAB, (3, 7), generator=torch.Generator().manual_seed(5))
    ref = DynamicCache(config=model.config)
    fx = FerroxCache(model.config, pool=pool, max_seq_len=16, batch_size=3)
    with torch.no_grad():
        _run(model, "sdpa", lambda: model(ids, cache=ref, use_cache=True))
        _run(model, "sdpa", lambda: model(ids, cache=fx, use_cache=True))
    return ref, fx


@pytest.mark.parametrize("indices", [
    torch.tensor([False, True, True]), [True, False, True], torch.tensor([2, 0]),
    torch.tensor([-1, 0]), [1], [0, 1, 1, 2], slice(1, None)],
    ids=["bool-tensor", "bool-list", "index-tensor", "negative", "list", "repeats", "slice"])
def test_batch_select_indices_takes_what_dynamic_cache_takes(llama, indices):
    pool = _pool(llama, 128)
    ref, fx = _prefilled_pair(llama, pool)
    ref.batch_select_indices(indices)
    fx.batch_select_indices(indices)
    for i in range(llama.config.num_hidden_layers):
        assert fx.layers[i].keys.shape == ref.layers[i].keys.shape
        assert torch.equal(fx.layers[i].keys, ref.layers[i].keys)
        assert torch.equal(fx.layers[i].values, ref.layers[i].values)
    fx.close()
    assert pool.free_blocks == 128


@pytest.mark.parametrize("indices, error, match", [
    (torch.tensor([True, False]), IndexError, "out of range"),       # a mask of the wrong length
    (torch.tensor([0, 3]), IndexError, "out of range"),
    ([False, False, False], ValueError, "no sequence"),
    (torch.tensor([0.0, 1.0]), TypeError, "integer indices or a boolean mask"),
    (torch.tensor([[0, 1]]), ValueError, "one dimension"),
])
def test_bad_batch_selections_are_refused_with_nothing_changed(llama, indices, error, match):
    pool = _pool(llama, 128)
    _, fx = _prefilled_pair(llama, pool)
    held, before = pool.used_blocks, fx.layers[0].keys.clone()
    with pytest.raises(error, match=match):
        fx.batch_select_indices(indices)
    assert fx.batch_size == 3 and pool.used_blocks == held
    assert torch.equal(before, fx.layers[0].keys)
    fx.close()
    assert pool.free_blocks == 128


# -- item 10: layers[i].keys / .values -------------------------------------

def _assert_layers_match(fx, ref, model, tol=1e-4):
    for i in range(model.config.num_hidden_layers):
        for name in ("keys", "values"):
            f, r = getattr(fx.layers[i], name), getattr(ref.layers[i], name)
            assert f.shape == r.shape and f.dtype == r.dtype
            torch.testing.assert_close(f, r, rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", ["greedy", "beam", "assisted"])
@pytest.mark.parametrize("pooled", [False, True])
def test_layer_keys_and_values_match_dynamic_cache_after_generate(llama, mode, pooled):
    ids = torch.randint(1, VOCAB, (1, 10), generator=torch.Generator().manual_seed(6))
    kw = {"greedy": {}, "beam": {"num_beams": 3},
          "assisted": {"assistant_model": llama}}[mode]
    new = 8
    ref = DynamicCache(config=llama.config)
    out = _run(llama, "sdpa", lambda: llama.generate(ids, cache=ref, max_new_tokens=new,
                                                      do_sample=False, **kw))
    pool = _pool(llama, 64) if pooled else None
    fx = FerroxCache(llama.config, pool=pool, max_seq_len=24 if pooled else None)
    got = _run(llama, "ferrox", lambda: llama.generate(ids, cache=fx, max_new_tokens=new,
                                                        do_sample=False, **kw))
    assert torch.equal(out, got)
    _, h, d = kv_geometry(llama.config)
    rows = 3 if mode == "beam" else 1
    # what transformers' generation tests check
    assert fx.layers[0].keys.shape == (rows, h, out.shape[1] - 1, d)
    _assert_layers_match(fx, ref, llama)
    fx.close()


def test_keys_of_a_contiguous_cache_of_batch_one_are_zero_copy(llama):
    import numpy as np
    fx = FerroxCache(llama.config, max_seq_len=32)
    assert fx.layers[0].keys is None and fx.layers[0].values is None
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(7))
    _run(llama, "ferrox", lambda: llama(ids, cache=fx, use_cache=True))
    seq = fx.layers[0].seqs[0]
    k, v = seq._views()
    assert np.shares_memory(fx.layers[0].keys.numpy(), k)
    assert np.shares_memory(fx.layers[0].values.numpy(), v)
    assert torch.equal(fx.layers[0].keys[0], torch.from_numpy(seq.k.copy()).permute(1, 0, 2))
    with pytest.raises(AttributeError, match="update"):
        fx.layers[0].keys = torch.zeros(1)
    fx.close()
    assert fx.layers[0].keys is None


def test_keys_take_the_model_s_dtype():
    m = _build("llama").to(torch.bfloat16)
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(8))
    ref, fx = DynamicCache(config=m.config), FerroxCache(m.config)
    _run(m, "sdpa", lambda: m(ids, cache=ref, use_cache=True))
    _run(m, "ferrox", lambda: m(ids, cache=fx, use_cache=True))
    assert torch.equal(fx.layers[0].keys, ref.layers[0].keys)    # before any attention ran
    _assert_layers_match(fx, ref, m, tol=3e-2)    # later layers: after bf16 attention


# -- item 11: no config ------------------------------------------------------

@pytest.mark.parametrize("impl", ["sdpa", "ferrox"])
def test_a_cache_without_a_config_takes_its_geometry_from_the_first_update(model, impl,
                                                                          monkeypatch):
    ids = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(9))
    ref = _run(model, "sdpa", lambda: model.generate(ids, cache=DynamicCache(), max_new_tokens=12,
                                                      do_sample=False))
    calls = []
    real = fhf.attend_many
    monkeypatch.setattr(fhf, "attend_many", lambda caches, q, **kw: calls.append(1) or real(caches, q, **kw))
    fx = FerroxCache()
    assert len(fx.layers) == 0 and fx.get_seq_length() == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _run(model, impl, lambda: model.generate(ids, cache=fx, max_new_tokens=12,
                                                        do_sample=False))
    assert torch.equal(ref, got)
    layers, h, d = kv_geometry(model.config)
    assert len(fx.layers) == layers and (fx.n_kv_heads, fx.head_dim) == (h, d)
    assert fx.get_seq_length() == got.shape[1] - 1
    # "ferrox" reads in place from the first step on
    assert len(calls) == (12 * layers if impl == "ferrox" else 0)


def test_a_cache_without_a_config_refuses_a_bad_first_update_and_stays_empty():
    fx = FerroxCache()
    with pytest.raises(ValueError, match="shaped"):
        fx.update(torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), 0)
    with pytest.raises(ValueError, match="differ"):
        fx.update(torch.zeros(1, 2, 3, 4), torch.zeros(2, 2, 3, 4), 1)
    assert len(fx.layers) == 0 and fx.n_kv_heads is None
    k = torch.randn(1, 2, 3, 4)
    fx.update(k, k, 0)
    assert torch.equal(fx.layers[0].keys, k)


def test_a_pool_without_a_config_and_a_model_for_a_config_are_refused(llama):
    pool = _pool(llama, 16)
    with pytest.raises(ValueError, match="model.config"):
        FerroxCache(pool=pool, max_seq_len=8)
    with pytest.raises(TypeError, match="model.config"):
        FerroxCache(llama)
    with pytest.raises(TypeError, match="model.config"):
        FerroxCache(object())
    assert pool.free_blocks == 16 and pool.stats()["acquired"] == 0


# -- a generate past the reservation ----------------------------------------

def test_generate_past_the_reservation_warns_once_and_names_it_when_the_pool_is_short(llama):
    layers = llama.config.num_hidden_layers
    ids = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(10))
    pool = _pool(llama, 2 * layers)               # exactly the reservation of 16 positions
    fx = FerroxCache(llama.config, pool=pool, max_seq_len=16)
    with pytest.warns(UserWarning, match="reserved 16") as record:
        with pytest.raises(KvPoolExhausted, match="reservation of 16 positions"):
            _run(llama, "ferrox", lambda: llama.generate(ids, cache=fx, max_new_tokens=10,
                                                          do_sample=False))
    assert sum("reserved 16" in str(w.message) for w in record) == 1
    assert fx.get_seq_length() == 16 and pool.used_blocks == 2 * layers
    fx.close()
    assert pool.free_blocks == 2 * layers


def test_generate_within_spare_blocks_warns_once_per_cache(llama):
    ids = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(11))
    pool = _pool(llama, 64)
    fx = FerroxCache(llama.config, pool=pool, max_seq_len=16)
    with pytest.warns(UserWarning, match="reserved 16") as record:
        out = _run(llama, "ferrox", lambda: llama.generate(ids, cache=fx, max_new_tokens=8,
                                                            do_sample=False))
        _run(llama, "ferrox", lambda: llama.generate(out, cache=fx, max_new_tokens=4,
                                                      do_sample=False))
    assert sum("reserved 16" in str(w.message) for w in record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # within the reservation: no warning
        fine = FerroxCache(llama.config, pool=pool, max_seq_len=21)
        _run(llama, "ferrox", lambda: llama.generate(ids, cache=fine, max_new_tokens=10,
                                                      do_sample=False))
    fx.close()
    fine.close()
    assert pool.free_blocks == 64
