"""The server's edges in process (the app over a started engine, through
starlette's TestClient; no server process): prompts a tokenizer encodes to
no tokens, unpaired surrogates in every text field, error bodies in
OpenAI's shape whatever fails (the body parser, routing), numbers that are
JSON numbers only, a stream whose chunks join to the whole text. After
every case the pool is as it was: ``pool.check()`` and every block back."""
import json
import os

import pytest

if os.environ.get("CI") or os.environ.get("FERROX_KV_REQUIRE_INSTALLED"):
    import fastapi  # noqa: F401  (in CI a missing serve dependency fails, never skips)
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from support import serve as S  # noqa: E402

from ferrox_kv import KvBlockPool  # noqa: E402


def _lossy_tokenizer(path):
    """A byte-level BPE without byte fallback: its alphabet is the bytes of
    ``TEXT`` only, so "é", an emoji or "\\x00" encode to no ids at all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "<s>", "</s>"])
    tok.train_from_iterator([S.TEXT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = S.CHAT_TEMPLATE
    fast.save_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import ferrox_kv.hf  # noqa: F401

    return S.make_model_dir(tmp_path_factory.mktemp("m") / "m", hidden=32, heads=2, kv_heads=1)


def _client(model_dir, tok=None, *, max_batch=2, blocks=64):
    from starlette.testclient import TestClient

    from ferrox_kv.serve.app import make_app
    from ferrox_kv.serve.engine import Engine
    from ferrox_kv.serve.metrics import Metrics

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                              attn_implementation="ferrox")
    tok = tok or transformers.AutoTokenizer.from_pretrained(model_dir)
    pool = KvBlockPool(16, blocks, 1, 16, prefix_cache=True)
    metrics = Metrics(pool)
    engine = Engine(model, tok, pool, max_batch=max_batch, max_queue=8, queue_timeout=5,
                    prefill_chunk=32, metrics=metrics)
    metrics.engine = engine
    asgi, _ = make_app(engine, metrics, model_name="m")
    engine.start()
    return TestClient(asgi, raise_server_exceptions=False), engine


@pytest.fixture(scope="module")
def served(model_dir):
    client, engine = _client(model_dir)
    with client:
        yield client, engine
    engine.close()
    engine.pool.check()
    assert engine.pool.used_blocks == 0


@pytest.fixture(scope="module")
def lossy(model_dir, tmp_path_factory):
    tok = _lossy_tokenizer(tmp_path_factory.mktemp("lossy"))
    assert tok("é")["input_ids"] == [] and tok("\x00")["input_ids"] == []
    client, engine = _client(model_dir, tok, max_batch=1)
    with client:
        yield client, engine
    engine.close()
    engine.pool.check()


def _pool_as_it_was(engine):
    """Nothing runs or waits, every block is back, the pool checks clean."""
    import time
    end = time.monotonic() + 30
    while engine.stats() != {"running": 0, "waiting": 0} and time.monotonic() < end:
        time.sleep(0.01)
    assert engine.stats() == {"running": 0, "waiting": 0}
    engine.pool.check()
    assert engine.pool.used_blocks == 0
    assert engine.pool.free_blocks == engine.pool.total_blocks


def _openai_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if param is not None:
        assert err["param"] == param, err
    return err


# -- defect 1: a prompt of no tokens ---------------------------------------------------

@pytest.mark.parametrize("prompt", ["\x00", "é", "\U0001F600", "é\x00é"])
def test_a_prompt_the_tokenizer_encodes_to_no_tokens_is_a_400_naming_prompt(lossy, prompt):
    client, engine = lossy
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    err = _openai_error(r, 400, "prompt")
    assert "no tokens" in err["message"]
    _pool_as_it_was(engine)


def test_prompts_of_no_tokens_never_hold_the_batch_slot(lossy):
    """max_batch 1: after many prompts of no tokens, a normal request is
    answered at once."""
    client, engine = lossy
    for _ in range(4):
        assert client.post("/v1/completions", json={"prompt": "é", "max_tokens": 2}
                           ).status_code == 400
    r = client.post("/v1/completions",
                    json={"prompt": "The pool is", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    _pool_as_it_was(engine)


def test_the_engine_fails_a_request_that_can_make_no_progress(lossy):
    """The step loop's invariant: a running request prefills or decodes; one
    that can do neither is failed and its blocks go back (not kept)."""
    import threading

    from ferrox_kv.serve.engine import Request, Sampling

    _, engine = lossy
    done = threading.Event()
    seen = []

    def emit(kind, payload):
        seen.append((kind, payload))
        if kind in ("error", "done"):
            done.set()

    r = Request([5], 4, Sampling(0), emit=emit)
    r.prompt_ids = []                      # what a tokenizer of no ids used to give
    engine.submit(r)
    assert done.wait(30), seen
    assert seen[-1][0] == "error" and "no progress" in str(seen[-1][1])
    _pool_as_it_was(engine)
    with pytest.raises(ValueError, match="at least one prompt token"):
        Request([], 4, Sampling(0))


# -- defect 2: unpaired surrogates -----------------------------------------------------

SURROGATE = [
    ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "a", "stop": "\udfff", "max_tokens": 2}, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": ["x", "\ud800"], "max_tokens": 2}, "stop.1"),
    ("/v1/completions", {"prompt": "a", "user": "\ud800", "max_tokens": 2}, "user"),
    ("/v1/completions", {"prompt": "a", "model": "\ud800", "max_tokens": 2}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                           {"role": "user", "content": [
                                               {"type": "text", "text": "x\udbff"}]}]},
     "messages.1.content.0.text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi",
                                            "name": "\ud800"}]}, "messages.0.name"),
]


@pytest.mark.parametrize("path,body,param", SURROGATE, ids=[s[2] for s in SURROGATE])
def test_an_unpaired_surrogate_in_any_text_field_is_a_400_naming_it(served, path, body, param):
    client, engine = served
    # json.dumps escapes the lone surrogate: valid JSON, as a client sends it
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    err = _openai_error(r, 400, param)
    assert "surrogate" in err["message"]
    _pool_as_it_was(engine)


def test_a_field_named_with_a_surrogate_is_a_400_not_a_500(served):
    client, engine = served
    for body in ({"prompt": "a", "\ud800": 1}, {"prompt": "a", "stream_options": {"\ud800": 1}}):
        r = client.post("/v1/completions", content=json.dumps(body),
                        headers={"content-type": "application/json"})
        _openai_error(r, 400)
    _pool_as_it_was(engine)


# -- defect 4: error bodies in OpenAI's shape ------------------------------------------

def test_json_nested_too_deep_and_a_body_not_utf8_get_openai_errors(served):
    client, engine = served
    deep = '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}"
    for content in (deep.encode(), b'{"prompt": "\xff\xfe"}', b"\xc3"):
        r = client.post("/v1/completions", content=content,
                        headers={"content-type": "application/json"})
        err = _openai_error(r, 400)
        assert "detail" not in r.json() and err["type"] == "invalid_request_error"
    _pool_as_it_was(engine)


def test_404_and_405_are_in_openai_error_shape(served):
    client, engine = served
    err = _openai_error(client.get("/v1/nothing"), 404)
    assert err["code"] == "not_found"
    r = client.get("/v1/completions")
    err = _openai_error(r, 405)
    assert err["code"] == "method_not_allowed" and "POST" in r.headers.get("allow", "")
    _openai_error(client.delete("/v1/models"), 405)
    _pool_as_it_was(engine)


# -- defect 5: numbers are JSON numbers ------------------------------------------------

LOOSE = [("temperature", True), ("temperature", "0.5"), ("top_p", "0.5"), ("top_p", False),
         ("presence_penalty", "0"), ("frequency_penalty", False)]


@pytest.mark.parametrize("field,value", LOOSE, ids=[f"{f}={v!r}" for f, v in LOOSE])
def test_a_bool_or_a_string_for_a_number_is_refused(served, field, value):
    client, engine = served
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, field: value})
    _openai_error(r, 400, field)
    _pool_as_it_was(engine)


def test_integers_and_floats_stay_accepted_as_numbers(served):
    client, engine = served
    for extra in ({"temperature": 0}, {"temperature": 0.0, "top_p": 1}, {"top_p": 0.5,
                                                                           "seed": 3}):
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, **extra})
        assert r.status_code == 200, (extra, r.text)
    _pool_as_it_was(engine)


# -- defect 3: a stream joins to the whole text ----------------------------------------

def _stream(client, body):
    text, reason = [], None
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                text.append(c["text"])
                reason = c["finish_reason"] or reason
    return text, reason


def test_streamed_chunks_join_to_the_whole_text_for_every_stop(served):
    """Greedy text of the model, then each of its substrings as a stop: the
    stream and the whole answer agree and neither holds the stop."""
    client, engine = served
    body = {"prompt": "The pool is", "max_tokens": 24, "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stops = {whole[i:i + n] for n in (1, 2, 3, 5) for i in range(0, len(whole) - n, 3)}
    stops.discard("")
    for stop in sorted(stops)[:24]:
        b = {**body, "stop": stop}
        want = client.post("/v1/completions", json=b).json()["choices"][0]
        chunks, reason = _stream(client, b)
        assert "".join(chunks) == want["text"], (stop, chunks, want)
        assert stop not in want["text"] and reason == want["finish_reason"] == "stop"
        assert want["text"] == whole[:whole.find(stop)]
    _pool_as_it_was(engine)


class _SplitTokenizer:
    """Ids 100.. decode to byte pieces that split 日 and 本 across tokens:
    100 "a", 101 the first two bytes of 日, 102 its last byte and the first
    of 本, 103 the rest of 本, 104 "b"."""
    ni, hon = "日".encode(), "本".encode()
    pieces = [b"a", ni[:2], ni[2:] + hon[:1], hon[1:], b"b"]
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[i - 100] for i in ids).decode("utf-8", "replace")


@pytest.mark.parametrize("stop,want", [("日本", "a"), ("本", "a日"), ("b", "a日本"),
                                       ("日本b", "a"), ("x", "a日本b")])
def test_the_engine_streams_no_part_of_a_stop_a_token_starts(model_dir, stop, want):
    """One token completes 日 and starts 本: with the stop "日本" the
    stream used to send 日 (its text ended in U+FFFD, and the hold-back
    looked for the stop's start only at the very end)."""
    from ferrox_kv.serve.engine import Engine, Request, Sampling

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                              attn_implementation="ferrox")
    engine = Engine(model, _SplitTokenizer(), KvBlockPool(16, 8, 1, 16))
    sent = []
    r = Request([5], 5, Sampling(0), stop=[stop],
                emit=lambda kind, payload: sent.append(payload) if kind == "token" else None)
    for token in range(100, 105):
        engine._accept(r, token)
        if r.finish_reason is not None:
            break
    assert r.text == want and "".join(sent) == want, (sent, r.text)
    assert r.finish_reason == ("length" if stop == "x" else "stop")


class _CountingTokenizer:
    """One letter per id (100 is "a"); counts the ids every ``decode`` is
    given."""

    eos_token_id = None

    def __init__(self):
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return "".join(chr(ord("a") + (i - 100) % 26) for i in ids)


def test_the_engine_decodes_each_new_token_once_not_the_whole_output(model_dir):
    """A request's per-token decode is O(the new text): over 400 tokens the
    engine's stream decodes at most a few ids per token, where decoding the
    whole output at each token would be 400 * 401 / 2."""
    from ferrox_kv.serve.engine import Engine, Request, Sampling

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                              attn_implementation="ferrox")
    tok = _CountingTokenizer()
    engine = Engine(model, tok, KvBlockPool(16, 8, 1, 16))
    sent = []
    n = 400
    r = Request([5], n, Sampling(0), stop=["zz"],
                emit=lambda kind, payload: sent.append(payload) if kind == "token" else None)
    for i in range(n):
        engine._accept(r, 100 + i % 25)       # never "zz": the letters a..y
    assert r.finish_reason == "length" and len(r.output_ids) == n
    want = "".join(chr(ord("a") + i % 25) for i in range(n))
    assert r.text == want and "".join(sent) == want
    assert tok.decoded <= 3 * n, tok.decoded
