"""``ferrox-kv serve`` as a client sees it: a real server process on loopback
(``python -m ferrox_kv.serve``) over a model directory these tests make.

Greedy completions equal ``model.generate`` with DynamicCache, alone and
batched; the openai client works; bad input never gets a 5xx nor leaks a
block; overload gets 200 / 503 + Retry-After / 400 only; clients that leave
give their blocks back; SIGTERM drains and the pool checks clean at exit.

The server pool (64 blocks of 16, 2 layers) holds 8 requests of 64
positions: "a pool sized for 8".
"""
import asyncio
import json
import os
import random
import re
import time

import pytest

from support import serve as S
from support.threads import run_threads

S_DEPS = ("torch", "transformers", "fastapi", "uvicorn", "prometheus_client", "httpx", "openai")
if os.environ.get("CI") or os.environ.get("FERROX_KV_REQUIRE_INSTALLED"):
    for _m in S_DEPS:            # in CI a missing serve dependency fails, never skips
        __import__(_m)
for _m in S_DEPS:
    pytest.importorskip(_m)

import httpx  # noqa: E402
import transformers  # noqa: E402

POOL_ARGS = ("--kv-blocks", 64, "--block-size", 16, "--max-batch", 8, "--max-queue", 16,
             "--queue-timeout", 3, "--prefill-chunk", 32)
PER_REQUEST = 64           # positions one request of the pool "for 8" reserves at most


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return S.make_model_dir(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(model_dir, workdir):
    srv = S.Server(model_dir, workdir, *POOL_ARGS)
    yield srv
    rc = srv.stop()
    log = srv.log()
    assert rc == 0, log
    assert "pool.check() passed, used_blocks=0" in log, log


@pytest.fixture(scope="module")
def ref(model_dir):
    """Greedy reference: transformers' generate with DynamicCache and SDPA."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="sdpa").eval()

    def gen(ids, max_tokens):
        new = S.greedy_new_ids(model, ids, max_tokens)
        return tok.decode(new, skip_special_tokens=True), len(
            [t for t in new if t != tok.eos_token_id])

    gen.tok = tok
    return gen


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=kw.pop("timeout", 60), **kw)


def stream_text(server, path, body):
    """(text joined from the SSE chunks, finish_reason, usage or None, chunks)."""
    text, reason, usage, chunks = [], None, None, []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        assert ln.startswith("data: ")
        d = json.loads(ln[6:])
        chunks.append(d)
        if d.get("usage"):
            usage = d["usage"]
        for c in d["choices"]:
            text.append(c["delta"].get("content", "") if "delta" in c else c["text"])
            reason = c["finish_reason"] or reason
    return "".join(text), reason, usage, chunks


def metric(server, name, labels=""):
    body = httpx.get(server.url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name + labels)} ([0-9.e+-]+)$", body, re.M)
    assert m, f"{name}{labels} missing from /metrics"
    return float(m.group(1))


def assert_blocks_back(server):
    h = server.wait_idle()
    assert h["running"] == h["waiting"] == 0, h
    assert h["used_blocks"] == 0, h
    assert h["free_blocks"] == h["total_blocks"], h
    return h


PROMPTS = ["The pool is", "A request reserves its worst case when it is admitted, so",
           "Tenants", "The quick brown fox jumps over the lazy dog; pack my box with five dozen",
           "Attention reads each sequence's own blocks", "0123456789 + - * /",
           "When the pool is full a request waits in a queue, first in first out, and after",
           "Sphinx of black quartz"]


# -- correctness ---------------------------------------------------------------

def test_greedy_completion_equals_generate_alone_streaming_and_not(server, ref):
    ids = ref.tok(PROMPTS[1])["input_ids"]
    want, n = ref(ids, 12)
    r = post(server, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 12,
                                          "temperature": 0})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "text_completion"
    assert d["choices"][0]["text"] == want
    assert d["usage"]["prompt_tokens"] == len(ids)
    assert d["usage"]["completion_tokens"] == n
    text, reason, _, _ = stream_text(server, "/v1/completions",
                                     {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0})
    assert text == want
    assert reason == d["choices"][0]["finish_reason"]
    assert_blocks_back(server)


def test_eight_batched_requests_of_different_lengths_equal_generate(server, ref):
    """8 requests at once, prompts and max_tokens all different, half of them
    streaming: every one equals its own generate, and decode steps ran more
    than one sequence per forward."""
    steps_before = metric(server, "ferrox:decode_batch_size_count")
    sum_before = metric(server, "ferrox:decode_batch_size_sum")
    cases = [(p, 6 + 3 * i) for i, p in enumerate(PROMPTS)]
    got = [None] * len(cases)

    def one(i):
        p, n = cases[i]
        body = {"prompt": p, "max_tokens": n, "temperature": 0}
        if i % 2:
            got[i] = stream_text(server, "/v1/completions", body)[0]
        else:
            r = post(server, "/v1/completions", body)
            got[i] = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text

    assert run_threads(len(cases), one, timeout=600) == []
    for (p, n), text in zip(cases, got):
        assert text == ref(ref.tok(p)["input_ids"], n)[0], p
    steps = metric(server, "ferrox:decode_batch_size_count") - steps_before
    seqs = metric(server, "ferrox:decode_batch_size_sum") - sum_before
    assert seqs > steps, f"{seqs} sequence-steps in {steps} forwards: nothing was batched"
    assert_blocks_back(server)


def test_chat_completion_uses_the_template_and_equals_generate(server, ref):
    msgs = [{"role": "system", "content": S.SYSTEM}, {"role": "user", "content": "What is a pool?"}]
    text = ref.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = ref.tok(text, add_special_tokens=False)["input_ids"]
    want, _ = ref(ids, 10)
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 10,
                                               "temperature": 0})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "chat.completion"
    assert d["choices"][0]["message"] == {"role": "assistant", "content": want}
    assert d["usage"]["prompt_tokens"] == len(ids)
    streamed, _, usage, chunks = stream_text(
        server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 10, "temperature": 0,
                                         "stream_options": {"include_usage": True}})
    assert streamed == want
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert usage["completion_tokens"] == d["usage"]["completion_tokens"]


def test_prefix_cache_reuses_a_shared_system_prompt_per_tenant(server, ref):
    """The second request with the same system prompt and tenant starts from
    cached blocks (usage says how many tokens) and still equals generate;
    another tenant shares nothing."""
    base = S.SYSTEM * 2
    first = post(server, "/v1/completions", {"prompt": base + "Question one?", "max_tokens": 4,
                                              "temperature": 0, "user": "tenant-a"}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    hits_before = metric(server, "ferrox:prefix_cache_hits_total")
    prompt = base + "Another question?"
    second = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 6,
                                               "temperature": 0, "user": "tenant-a"}).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16 and cached % 16 == 0, second["usage"]
    assert second["choices"][0]["text"] == ref(ref.tok(prompt)["input_ids"], 6)[0]
    assert metric(server, "ferrox:prefix_cache_hits_total") - hits_before == cached
    other = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0},
                 headers={"X-Tenant": "tenant-b"}).json()
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert other["choices"][0]["text"] == second["choices"][0]["text"]
    h = assert_blocks_back(server)
    assert h["cached_blocks"] > 0


def test_sampling_with_a_seed_is_reproducible_and_stop_ends_the_text(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.9, "top_p": 0.9, "seed": 7}
    a = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    b = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    assert a == b
    greedy = post(server, "/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 16,
                                               "temperature": 0}).json()["choices"][0]["text"]
    if len(greedy) >= 4:
        stop = greedy[2:4]
        r = post(server, "/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 16,
                                              "temperature": 0, "stop": [stop]}).json()
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["choices"][0]["text"] == greedy[:greedy.index(stop)]
        s, reason, _, _ = stream_text(server, "/v1/completions", {
            "prompt": PROMPTS[3], "max_tokens": 16, "temperature": 0, "stop": stop})
        assert (s, reason) == (greedy[:greedy.index(stop)], "stop")


def test_openai_client_works(server, ref):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny-llama"]
    c = client.completions.create(model="tiny-llama", prompt=PROMPTS[2], max_tokens=8,
                                  temperature=0)
    assert c.choices[0].text == ref(ref.tok(PROMPTS[2])["input_ids"], 8)[0]
    assert c.usage.prompt_tokens == len(ref.tok(PROMPTS[2])["input_ids"])
    msgs = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=6,
                                          temperature=0, user="t1")
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="tiny-llama", messages=msgs, max_tokens=6, temperature=0, stream=True, user="t1")
        if ch.choices]
    assert "".join(parts) == chat.choices[0].message.content
    assert chat.usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=-1)
    assert "max_tokens" in str(e.value)


def test_metrics_in_vllm_style(server):
    body = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("ferrox:kv_cache_usage_perc", "ferrox:kv_blocks_free", "ferrox:kv_blocks_used",
                 "ferrox:kv_blocks_cached", "ferrox:prefix_cache_queries_total",
                 "ferrox:prefix_cache_hits_total", "ferrox:num_requests_running",
                 "ferrox:num_requests_waiting", "ferrox:request_refused_total",
                 "ferrox:num_preemptions_total", "ferrox:time_to_first_token_seconds_bucket",
                 "ferrox:inter_token_latency_seconds_bucket",
                 "ferrox:e2e_request_latency_seconds_bucket", "ferrox:prompt_tokens_total",
                 "ferrox:generation_tokens_total", "ferrox:decode_batch_size_bucket"):
        assert re.search(rf"^{re.escape(name)}[ {{]", body, re.M), name
    assert metric(server, "ferrox:num_preemptions_total") == 0


# -- bad input -------------------------------------------------------------------

BAD = [
    ("empty prompt", {"prompt": "", "max_tokens": 4}, 400, "prompt"),
    ("empty token list", {"prompt": [], "max_tokens": 4}, 400, "prompt"),
    ("negative max_tokens", {"prompt": "a", "max_tokens": -3}, 400, "max_tokens"),
    ("zero max_tokens", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("huge max_tokens", {"prompt": "a", "max_tokens": 10 ** 9}, 400, "max_tokens"),
    ("max_tokens past the pool", {"prompt": "a", "max_tokens": 600}, 400, "max_tokens"),
    ("unknown field", {"prompt": "a", "max_tokens": 2, "frobnicate": 1}, 400, "frobnicate"),
    ("max_tokens a string", {"prompt": "a", "max_tokens": "4"}, 400, "max_tokens"),
    ("prompt a number", {"prompt": 5, "max_tokens": 4}, 400, "prompt"),
    ("temperature a list", {"prompt": "a", "temperature": [1]}, 400, "temperature"),
    ("temperature too high", {"prompt": "a", "temperature": 9}, 400, "temperature"),
    ("stream a string", {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("n of 3", {"prompt": "a", "n": 3}, 400, "n"),
    ("five stop strings", {"prompt": "a", "stop": list("abcde")}, 400, "stop"),
    ("a stop string of 10**5 characters", {"prompt": "a", "stop": "x" * 10 ** 5}, 400, "stop"),
    ("a seed beyond 64 bits", {"prompt": "a", "seed": 1 << 70}, 400, "seed"),
    ("token id out of range", {"prompt": [1, 10 ** 6]}, 400, "prompt"),
    ("negative token id", {"prompt": [-1]}, 400, "prompt"),
    ("a model not served", {"prompt": "a", "model": "gpt-5"}, 404, "model"),
    ("a body that is a list", [1, 2], 400, None),
]


@pytest.mark.parametrize("what,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_completion_requests_get_a_4xx_naming_the_field(server, what, body, status, param):
    r = post(server, "/v1/completions", body)
    assert r.status_code == status, (what, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param or param in err["message"], err


def test_prompt_beyond_the_context_is_refused_at_once(server, ref):
    long_prompt = "The quick brown fox " * 400          # well past 1024 positions
    r = post(server, "/v1/completions", {"prompt": long_prompt, "max_tokens": 2})
    assert r.status_code == 400
    assert "context" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"prompt": "a", "max_tokens": 600})
    assert r.status_code == 400 and "--kv-blocks" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions",
             {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 2})
    assert r.status_code == 400


def test_bad_chat_requests(server):
    for body in ({"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
                 {"messages": [{"role": "user"}]}, {"messages": "hello"},
                 {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}):
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"].startswith(("messages", "max_completion_tokens"))


def test_invalid_json_and_a_10_mb_body(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "a", ',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    big = json.dumps({"prompt": "a" * (10 << 20), "max_tokens": 1}).encode()
    r = httpx.post(server.url + "/v1/completions", content=big,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413
    # a body streamed without Content-Length is cut off as it arrives
    r = httpx.post(server.url + "/v1/completions", content=iter([big[i:i + 65536] for i in
                                                                 range(0, len(big), 65536)]),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413
    assert_blocks_back(server)


# -- overload, disconnects, soak ------------------------------------------------------

async def _client(url, body, *, drop_after=None, timeout=60.0):
    """One request; ``drop_after`` chunks (streaming) or seconds (a timeout
    while queued or running) and the client goes away."""
    async with httpx.AsyncClient(timeout=timeout) as c:
        if body.get("stream"):
            try:
                async with c.stream("POST", url, json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        return r.status_code, r.headers.get("retry-after"), None
                    n = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            n += 1
                            if drop_after is not None and n >= drop_after:
                                return "dropped", None, None
                    return 200, None, None
            except httpx.TimeoutException:
                return "dropped", None, None
        try:
            r = await c.post(url, json=body)
        except httpx.TimeoutException:
            return "dropped", None, None
        return r.status_code, r.headers.get("retry-after"), r


def test_overload_64_clients_on_a_pool_for_8(server):
    """Only 200, 503 with Retry-After (queue full or queue timeout) and 400
    (never fits); no 5xx; every block back."""
    rng = random.Random(5)
    bodies = []
    for i in range(64):
        if i % 16 == 15:
            bodies.append({"prompt": "a b c", "max_tokens": 5000})          # never fits
        else:
            bodies.append({"prompt": S.SYSTEM[:rng.randrange(5, 120)], "temperature": 0,
                           "max_tokens": rng.randrange(8, 24), "stream": i % 3 == 0})

    async def main():
        return await asyncio.gather(*[_client(server.url + "/v1/completions", b)
                                      for b in bodies])

    results = asyncio.run(main())
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 400, 503}, statuses
    assert statuses.count(400) == 4
    assert 200 in statuses and 503 in statuses, statuses
    for s, retry, _ in results:
        if s == 503:
            assert retry is not None and int(retry) >= 1
    assert metric(server, "ferrox:request_refused_total", '{reason="queue_full"}') > 0
    assert_blocks_back(server)


def test_clients_that_leave_give_their_blocks_back(server):
    """Clients drop at random points (mid-stream, while queued, while running
    without streaming); the engine stops their sequences and every block
    comes back."""
    rng = random.Random(11)
    before = metric(server, "ferrox:request_cancelled_total", '{where="running"}')

    async def main():
        jobs = []
        for i in range(24):
            body = {"prompt": S.SYSTEM[:rng.randrange(5, 100)], "max_tokens": 40,
                    "temperature": 0, "stream": i % 2 == 0}
            if i % 2 == 0:
                jobs.append(_client(server.url + "/v1/completions", body,
                                    drop_after=rng.randrange(1, 6)))
            else:
                jobs.append(_client(server.url + "/v1/completions", body,
                                    timeout=rng.uniform(0.05, 0.6)))
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    assert "dropped" in [s for s, _, _ in results]
    assert all(s in (200, 503, "dropped") for s, _, _ in results), results
    assert_blocks_back(server)
    assert metric(server, "ferrox:request_cancelled_total", '{where="running"}') > before


SOAK_REQUESTS = int(os.environ.get("FERROX_KV_SOAK_REQUESTS", "120"))


def test_soak_random_lengths_and_disconnects_loses_no_block(server):
    """A short soak (FERROX_KV_SOAK_REQUESTS, 120 in CI; benchmarks/serve_load.py
    --soak runs 10**4): random prompts, lengths and disconnects, 16 clients at
    a time; then zero blocks lost and resident memory flat."""
    rng = random.Random(3)

    def body():
        b = {"prompt": S.TEXT[:rng.randrange(1, 200)], "max_tokens": rng.randrange(1, 30),
             "temperature": rng.choice([0, 0.8]), "stream": rng.random() < 0.5,
             "user": rng.choice([None, "a", "b"])}
        return {k: v for k, v in b.items() if v is not None}

    async def run(n):
        sem = asyncio.Semaphore(16)

        async def one():
            async with sem:
                drop = rng.random() < 0.2
                return await _client(server.url + "/v1/completions", body(),
                                     drop_after=rng.randrange(1, 8) if drop else None,
                                     timeout=rng.uniform(0.05, 0.5) if drop else 60)
        return await asyncio.gather(*[one() for _ in range(n)])

    asyncio.run(run(32))                          # warm up: allocator, caches, metrics
    assert_blocks_back(server)
    rss0 = server.rss_kib()
    results = asyncio.run(run(SOAK_REQUESTS))
    assert all(s in (200, 503, "dropped") for s, _, _ in results), \
        sorted({str(s) for s, _, _ in results})
    assert_blocks_back(server)
    rss1 = server.rss_kib()
    assert rss1 <= rss0 * 1.15 + 16 * 1024, (rss0, rss1)


# -- shutdown, threads mode -------------------------------------------------------------

@pytest.mark.long
def test_threads_mode_equals_generate_and_sigterm_drains(model_dir, workdir, ref):
    """--mode threads gives the same greedy text; SIGTERM lets a running
    stream finish while a new request gets 503 + Retry-After; the process
    exits 0 with the pool checked clean."""
    srv = S.Server(model_dir, workdir, *POOL_ARGS, "--mode", "threads")
    try:
        got = [None] * 4

        def one(i):
            got[i] = post(srv, "/v1/completions", {"prompt": PROMPTS[i], "max_tokens": 8 + i,
                                                   "temperature": 0}).json()["choices"][0]["text"]

        assert run_threads(4, one, timeout=600) == []
        for i in range(4):
            assert got[i] == ref(ref.tok(PROMPTS[i])["input_ids"], 8 + i)[0]

        lines = []
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                          json={"prompt": "a", "max_tokens": 480, "temperature": 0,
                                "stream": True}) as r:      # runs for a second or more
            it = r.iter_lines()
            lines.append(next(it))                     # running
            srv.proc.send_signal(__import__("signal").SIGTERM)
            time.sleep(0.1)
            late = post(srv, "/v1/completions", {"prompt": "a", "max_tokens": 2})
            lines += list(it)
        assert late.status_code == 503, late.text
        assert int(late.headers["retry-after"]) >= 1
        assert late.json()["error"]["code"] == "shutting_down"
        lines = [ln for ln in lines if ln]
        assert len(lines) > 100                        # it ran on after the signal
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")
        srv.proc.wait(60)
    finally:
        rc = srv.stop()
    assert rc == 0, srv.log()
    assert "pool.check() passed, used_blocks=0" in srv.log()


def test_threads_mode_with_dynamic_cache_equals_generate(model_dir, workdir, ref):
    """--mode threads --threads-cache dynamic (the load test's baseline:
    DynamicCache and SDPA, one thread per request): greedy completions equal
    generate, batched and streaming; nothing comes from the prefix cache and
    nothing is published; its reservations all come back."""
    srv = S.Server(model_dir, workdir, *POOL_ARGS, "--mode", "threads",
                   "--threads-cache", "dynamic")
    try:
        got = [None] * 6

        def one(i):
            body = {"prompt": PROMPTS[i], "max_tokens": 6 + 2 * i, "temperature": 0}
            if i % 2:
                got[i] = stream_text(srv, "/v1/completions", body)[:3:2]
            else:
                d = post(srv, "/v1/completions", body).json()
                got[i] = d["choices"][0]["text"], d["usage"]

        assert run_threads(len(got), one, timeout=600) == []
        for i, (text, usage) in enumerate(got):
            assert text == ref(ref.tok(PROMPTS[i])["input_ids"], 6 + 2 * i)[0], PROMPTS[i]
        again = post(srv, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 6,
                                              "temperature": 0}).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["choices"][0]["text"] == got[0][0]
        h = assert_blocks_back(srv)
        assert h["cached_blocks"] == 0              # nothing was published
    finally:
        rc = srv.stop()
    assert rc == 0, srv.log()
    assert "pool.check() passed, used_blocks=0" in srv.log()


def test_threads_cache_dynamic_needs_threads_mode(model_dir, workdir):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "ferrox_kv.serve", model_dir,
                          "--threads-cache", "dynamic"], cwd=workdir, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "pass --mode threads" in out.stderr, out.stderr


# -- schemathesis against the app's own OpenAPI document ------------------------------

SCHEMA_EXAMPLES = int(os.environ.get("FERROX_KV_SCHEMA_EXAMPLES", "15"))


def test_schemathesis_finds_no_5xx_and_no_leaked_block(server):
    """Requests generated from /openapi.json for every operation, valid and
    invalid (SCHEMA_EXAMPLES of each per operation, no deadline): never a
    5xx, and every request's blocks come back."""
    if os.environ.get("CI") or os.environ.get("FERROX_KV_REQUIRE_INSTALLED"):
        import schemathesis
    else:
        schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                       "/health", "/metrics"}
    seen = []
    for op in ops:
        modes = [GenerationMode.POSITIVE]
        if op.method.upper() == "POST":          # a GET without parameters has no invalid form
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=SCHEMA_EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case):
                if isinstance(case.body, dict) and "messages" in case.body:   # bounded time
                    for k in ("max_tokens", "max_completion_tokens"):
                        v = case.body.get(k)
                        if v is None or (isinstance(v, int) and not isinstance(v, bool)
                                         and v > 32):
                            case.body[k] = 32
                elif isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
                    case.body["max_tokens"] = min(case.body["max_tokens"], 32)
                response = case.call(base_url=server.url, timeout=60)
                seen.append(response.status_code)
                assert response.status_code < 500, (case.method, case.path, case.body,
                                                    response.text)
            run()
    assert 200 in seen and 400 in seen, sorted(set(seen))
    assert_blocks_back(server)


# -- the serving examples of the README and docs/serving.md, against the live server ----

def test_docs_serving_examples_run_as_written(server, capsys):
    """The curl example (README and docs/serving.md) and the openai example
    (docs/serving.md), with their address replaced by the test server's."""
    import shutil
    import subprocess

    from support import docs

    assert shutil.which("curl"), "the docs' curl example needs curl"
    here = server.url.replace("http://", "")
    cmd = docs.block("docs/serving.md", "curl -s", "bash")
    assert cmd == docs.block("README.md", "curl -s", "bash")
    cmd = cmd.replace("127.0.0.1:8000", here)
    # the shell and curl are the user's programs, not ferrox's: they run without
    # the ASan pass's LD_PRELOAD (curl's resolver thread hangs under libasan)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["choices"][0]["finish_reason"] in ("length", "stop") and d["usage"]["prompt_tokens"]
    code = docs.block("docs/serving.md", "OpenAI(base_url").replace("127.0.0.1:8000", here)
    exec(compile(code, "docs/serving.md", "exec"), {"__name__": "docs"})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("turn 0:") and lines[0].endswith(" 0 from the prefix cache")
    cached = int(lines[1].split(", ")[1].split()[0])
    assert lines[1].startswith("turn 1:") and cached >= 16, lines
    assert len(lines) >= 3                 # then the streamed text (a random model's: may hold newlines)
    assert_blocks_back(server)
