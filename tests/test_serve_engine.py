"""The serve engine in process: the Retry-After estimate, the never-fits
check, and the FIFO head that nobody overtakes (no server, no HTTP)."""
import os

import pytest

if os.environ.get("CI") or os.environ.get("FERROX_KV_REQUIRE_INSTALLED"):
    import fastapi  # noqa: F401  (in CI a missing serve dependency fails, never skips)
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from support import serve as S  # noqa: E402

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
    for opt in ("--kv-gib", "--kv-blocks", "--block-size", "--dtype", "--kv-dtype", "--mode",
                "--threads-cache",
                "--max-batch",
                "--max-queue", "--queue-timeout", "--host", "--port"):
        assert opt in out.stdout
    out = subprocess.run([sys.executable, "-m", "ferrox_kv.serve", str(tmp_path / "missing")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "is not a directory" in out.stderr and "save_pretrained" in out.stderr
    assert "--make-tiny" in out.stderr


def test_a_missing_model_dir_is_said_before_torch_is_imported(tmp_path):
    import subprocess
    import sys

    code = ("import sys\nfrom ferrox_kv.serve.cli import main\ntry:\n"
            f"    main([{str(tmp_path / 'nope')!r}])\nexcept SystemExit as e:\n"
            "    print('exit', e)\nprint('torch imported:', 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert "is not a directory" in out.stdout and "--make-tiny" in out.stdout, out
    assert "torch imported: False" in out.stdout, out


def test_serve_leaves_torchs_openmp_wait_policy_as_the_environment_has_it(tmp_path):
    """The ferrox attention splits on torch's OpenMP team, whose spinning
    threads serve it best: the server sets no policy of its own."""
    import os
    import subprocess
    import sys

    d = S.make_model_dir(tmp_path / "m", hidden=32, heads=2, kv_heads=1)
    code = ("import argparse, os, sys\nfrom ferrox_kv.serve.cli import add_arguments, load\n"
            "assert 'torch' not in sys.modules\n"
            "ap = argparse.ArgumentParser()\nadd_arguments(ap)\n"
            f"load(ap.parse_args([{str(d)!r}, '--kv-gib', '0.001']))\n"
            "print('policy', os.environ.get('OMP_WAIT_POLICY'))\n")
    for given, want in ((None, "None"), ("PASSIVE", "PASSIVE")):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if given is not None:
            env["OMP_WAIT_POLICY"] = given
        out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and f"policy {want}" in out.stdout, out


def test_a_busy_port_is_refused_before_the_server_says_where_it_listens(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "ferrox_kv.serve", str(tmp_path),
                              "--port", str(port)], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120)
    assert out.returncode != 0
    assert "cannot listen on 127.0.0.1:" in out.stderr and "--port" in out.stderr, out.stderr
    assert "on http://" not in out.stderr, out.stderr


def test_the_help_texts_describe_the_commands_not_their_modules(tmp_path):
    import subprocess
    import sys

    for args in (["serve", "--help"], ["bench", "--help"]):
        out = subprocess.run([sys.executable, "-m", "ferrox_kv", *args], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        for internal in ("``", "uvicorn", "harness", "runner", "GROUP_MODULES", ".py"):
            assert internal not in out.stdout, (args, internal)


@pytest.mark.parametrize("temperature", [5.5e-72, 1e-320, 1e-30])
def test_a_tiny_temperature_samples_the_argmax(temperature):
    # logits / temperature overflowed to inf, and softmax of inf - inf is NaN:
    # torch.multinomial then refused the probabilities (a 500 for the request)
    from ferrox_kv.serve.engine import Sampling

    logits = torch.tensor([1.0, 3.0, -2.0, 2.5, float("-inf")])
    s = Sampling(temperature, seed=0)
    assert [s.pick(logits) for _ in range(20)] == [1] * 20


def test_sampling_follows_the_softmax_at_temperature_one():
    from ferrox_kv.serve.engine import Sampling

    logits = torch.tensor([0.0, 1.0, 2.0])
    s = Sampling(1.0, seed=1)
    n = 4000
    counts = torch.bincount(torch.tensor([s.pick(logits) for _ in range(n)]), minlength=3)
    want = torch.softmax(logits, 0) * n
    assert (counts.double() - want.double()).abs().max() < 5 * want.max().sqrt()


@pytest.mark.parametrize("dtype, kv_dtype, want", [("float32", "auto", "float32"),
                                                   ("bfloat16", "auto", "bfloat16"),
                                                   ("float32", "int8", "int8"),
                                                   ("float32", "float16", "float16")])
def test_the_pool_stores_kv_dtype_and_kv_gib_counts_its_bytes(tmp_path, dtype, kv_dtype, want):
    import argparse

    from ferrox_kv.serve.cli import add_arguments, load

    d = S.make_model_dir(tmp_path / "m", hidden=32, heads=2, kv_heads=1)
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args([str(d), "--kv-gib", "0.001", "--dtype", dtype, "--kv-dtype", kv_dtype])
    model, _, pool = load(args)
    assert pool.dtype == want and model.dtype == getattr(torch, dtype)
    assert pool.total_blocks == int(0.001 * (1 << 30) // pool.block_bytes)
    f32 = KvBlockPool(16, 1, 1, 16).block_bytes
    assert pool.block_bytes == {"float32": f32, "float16": f32 // 2, "bfloat16": f32 // 2,
                                "int8": 2 * 16 * (16 + 2)}[want]


def _serve_one(model, tok, pool):
    """One greedy request through an Engine on ``pool``, to its end: the
    kinds of event it emitted."""
    import threading

    from ferrox_kv.serve.engine import Engine, Request, Sampling

    engine = Engine(model, tok, pool)
    got, done = [], threading.Event()

    def emit(kind, payload):
        got.append(kind)
        if kind in ("done", "error"):
            done.set()

    engine.start()
    try:
        engine.submit(Request(list(range(3, 12)), 6, Sampling(0), emit=emit))
        assert done.wait(60), got
    finally:
        engine.close()
    return got


def test_kv_dtype_int4_stores_rotated_int4_rows_of_a_head_dim_of_32_and_serves(tmp_path):
    import argparse

    from ferrox_kv.serve.cli import add_arguments, load

    d = S.make_model_dir(tmp_path / "m", hidden=64, heads=2, kv_heads=1)
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    model, tok, pool = load(ap.parse_args([str(d), "--kv-gib", "0.001", "--kv-dtype", "int4"]))
    assert pool.dtype == "int4" and pool.rotate
    assert pool.block_bytes == 2 * 16 * (16 + 2)       # K and V: 16 bytes and a scale per row
    assert pool.total_blocks == int(0.001 * (1 << 30) // pool.block_bytes)
    got = _serve_one(model, tok, pool)
    assert got.count("token") >= 1 and got[-1] == "done", got
    pool.check()


def test_an_int8_pool_serves_a_request_to_its_end(parts):
    model, tok = parts
    pool = KvBlockPool(16, 32, 1, 16, prefix_cache=True, dtype="int8")
    got = _serve_one(model, tok, pool)
    assert got.count("token") >= 1 and got[-1] == "done", got
    assert pool.used_blocks == pool.cached_blocks     # the finished request's blocks: cached
    pool.check()


def test_threads_cache_is_ferrox_or_dynamic_and_dynamic_needs_threads_mode(parts):
    with pytest.raises(ValueError, match="pass mode='threads'"):
        _engine(parts, threads_cache="dynamic")
    with pytest.raises(ValueError, match="'ferrox' or 'dynamic'"):
        _engine(parts, mode="threads", threads_cache="static")
    assert _engine(parts, mode="threads", threads_cache="dynamic").threads_cache == "dynamic"


def test_prompts_admitted_together_prefill_in_one_forward_with_decode_and_equal_generate(parts):
    """One step packs a decoding sequence's next token and the prompt chunks
    of three requests admitted together (the third split by the step's
    prefill budget, finished in the next step) into one forward; every
    greedy completion equals generate with DynamicCache and SDPA."""
    from ferrox_kv.serve.engine import Request, Sampling

    model, tok = parts
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        model.name_or_path, attn_implementation="sdpa").eval()

    def want(ids, n):
        new = S.greedy_new_ids(ref, ids, n)
        return new[:new.index(tok.eos_token_id)] if tok.eos_token_id in new else new

    budget = 48
    e = _engine(parts, blocks=64, prefill_chunk=budget)
    seen = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    texts = [S.TEXT[:40], S.TEXT[100:120], S.TEXT[200:240], S.TEXT[300:400]]
    reqs = [Request(tok(t)["input_ids"], n, Sampling(0)) for t, n in zip(texts, (12, 5, 9, 7))]
    lens = [len(r.prompt_ids) for r in reqs]
    assert lens[1] + lens[2] < budget < lens[1] + lens[2] + lens[3]
    rest = lens[3] - (budget - lens[1] - lens[2])
    assert rest <= budget
    try:
        with torch.inference_mode():
            e.submit(reqs[0])
            e._admit()
            while not reqs[0].output_ids:
                e._step(list(e._running))
            for r in reqs[1:]:
                e.submit(r)
            e._admit()
            assert len(e._running) == 4
            seen.clear()
            e._step(list(e._running))
            assert seen == [(1, 1 + budget)]      # one forward: a decode + the budget's prompts
            assert [len(r.output_ids) for r in reqs[1:]] == [1, 1, 0]
            assert reqs[3].caches[0].seq_len == lens[3] - rest
            e._step(list(e._running))
            assert seen[1] == (1, 3 + rest)       # three decode, the rest of the split prompt
            assert len(reqs[3].output_ids) == 1
            while e._running:
                e._step(list(e._running))
    finally:
        hook.remove()
        with e._cv:
            for r in list(e._running):
                e._retire(r, publish=False)
    for r in reqs:
        assert r.output_ids == want(r.prompt_ids, r.max_tokens), r.prompt_ids
    assert e.pool.free_blocks == e.pool.total_blocks and e.pool.cached_blocks > 0   # published
    e.pool.check()


def test_the_tiny_model_writes_printable_text_greedy_and_sampled(parts):
    """--make-tiny's model answered in U+FFFD; its output head now gives
    every token that does not print a zero row."""
    model, tok = parts
    for prompt in ("The pool is", "Sphinx of black quartz", "é 😀 \x00"):
        ids = torch.tensor([tok(prompt)["input_ids"] or [tok.bos_token_id]])
        for sample in (False, True):
            torch.manual_seed(3)
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=48, do_sample=sample, temperature=1.0,
                                     top_p=1.0, pad_token_id=tok.pad_token_id)
            text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            assert text and "\ufffd" not in text, (prompt, sample, text)
            assert all(c.isprintable() or c in "\n\t" for c in text), (prompt, sample, text)


def test_close_refuses_the_requests_waiting_for_a_fetch_without_fetching_them(parts):
    """close() while one read-through runs and two wait for the fetcher:
    the running one ends, the waiting ones never reach the store, and all
    three get their 503 (shutting_down); no block is left held."""
    import threading

    from ferrox_kv.serve.engine import Request, Sampling
    from ferrox_kv.serve.protocol import Overloaded

    entered, release, fetched, got = threading.Event(), threading.Event(), [], {}

    def fetch(ids, salt):
        fetched.append(salt)
        entered.set()
        assert release.wait(60)

    e = _engine(parts, blocks=32, fetch=fetch, fetch_threads=1)
    e.start()
    names = ("first", "second", "third")
    for name in names:
        e.submit(Request(list(range(3, 11)), 2, Sampling(0), tenant=name,
                         emit=lambda kind, p, name=name: got.setdefault(name, []).append(
                             (kind, p))))
    assert entered.wait(60)
    closer = threading.Thread(target=e.close)
    closer.start()
    try:
        with e._cv:
            assert e._cv.wait_for(lambda: e._stopping, 60)
    finally:
        release.set()
        closer.join(60)
    assert not closer.is_alive()
    assert fetched == ["first"]
    for name in names:
        errors = [p for kind, p in got.get(name, []) if kind == "error"]
        assert len(errors) == 1 and isinstance(errors[0], Overloaded), (name, got)
        assert errors[0].reason == "shutting_down"
    assert e.pool.used_blocks == 0
    e.pool.check()


def test_a_tenant_is_admitted_by_a_pool_without_a_prefix_cache(parts):
    """The tenant is the prefix cache's salt: without a lookup it is not
    passed on, so admission does not raise ("salt= goes with tokens=") in
    the scheduler thread."""
    from ferrox_kv.serve.engine import Engine, Request, Sampling

    model, tok = parts
    pool = KvBlockPool(16, 32, 1, 16)
    e = Engine(model, tok, pool)
    r = Request(list(range(3, 12)), 4, Sampling(0), tenant="tenant-a")
    with e._cv:
        e._queue.append(r)
        e._admit()
        assert e._running == [r] and r.caches is not None
        e._retire(r, publish=True)
    assert pool.used_blocks == 0
    pool.check()
