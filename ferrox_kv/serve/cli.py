"""``ferrox-kv serve``: arguments, loading a local checkpoint, uvicorn, and
graceful shutdown.

SIGTERM (or Ctrl-C) stops admitting: new and queued requests get 503 with
Retry-After while the running ones finish, up to ``--shutdown-timeout``
seconds; then the server exits, cancelling what is left, writes what is
queued for Redis, saves ``--prefix-file`` (atomically; a failed save is
logged and leaves the previous file), and checks the pool
(``pool.check()``; every block must be back). A second signal exits at
once, without saving. The process never forks: uvicorn runs in it with one
worker.
"""
from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
import threading

DESCRIPTION = """\
An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics) over a local transformers checkpoint, whose
KV lives in one ferrox_kv pool: continuous batching, admission by the pool
(a request that cannot get its blocks waits, then gets 503 + Retry-After),
a prefix cache per tenant.

SIGTERM (or Ctrl-C) stops admitting and lets the running requests finish,
up to --shutdown-timeout seconds; a second signal exits at once.

    ferrox-kv serve ./tiny-llama --make-tiny     # a tiny random model, offline"""

DTYPES = ("float32", "bfloat16", "float16")
KV_DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("model_dir", metavar="MODEL_DIR",
                    help="a local transformers checkpoint with its tokenizer (a path; never "
                         "downloaded)")
    kv = ap.add_mutually_exclusive_group()
    kv.add_argument("--kv-gib", type=float, default=None,
                    help="the pool's size in GiB (default 0.5)")
    kv.add_argument("--kv-blocks", type=int, default=None, help="the pool's size in blocks")
    ap.add_argument("--block-size", type=int, default=16, help="positions per block (16)")
    ap.add_argument("--dtype", choices=("auto",) + DTYPES, default="auto",
                    help="the model's weights; auto (the default): the checkpoint's own "
                         "dtype (its config's dtype / torch_dtype, float32 when it names none), "
                         "as vLLM and transformers' dtype='auto' load it")
    ap.add_argument("--kv-dtype", choices=("auto",) + KV_DTYPES, default="auto",
                    help="how the pool stores K/V; auto: the dtype the model runs in (int8: "
                         "q8_0, 3.76x float32's sequences in the same memory; int4: q4_0 with a "
                         "Hadamard rotation, 7.1x; its head dim must be a multiple of 32)")
    ap.add_argument("--mode", choices=("batch", "threads"), default="batch",
                    help="batch: continuous batching, one forward per step over every running "
                         "sequence; threads: one thread per request, batch 1 (the baseline)")
    ap.add_argument("--threads-cache", choices=("ferrox", "dynamic"), default="ferrox",
                    help="threads mode's K/V: ferrox (its reservation in the pool, the prefix "
                         "cache on) or dynamic (transformers' DynamicCache and SDPA, as generate "
                         "runs; the reservation is the admission ticket only)")
    ap.add_argument("--max-batch", type=int, default=16,
                    help="most sequences running at once (16)")
    ap.add_argument("--max-queue", type=int, default=64,
                    help="most requests waiting for blocks; beyond it 503 (64)")
    ap.add_argument("--queue-timeout", type=float, default=30.0,
                    help="seconds a request may wait for blocks before a 503 (30)")
    ap.add_argument("--prefill-chunk", type=int, default=256,
                    help="prompt positions prefilled per step: all admitted requests together "
                         "in batch mode, each request's own in threads mode (256)")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="turn the pool's prefix cache off")
    ap.add_argument("--no-sliding-windows", action="store_true",
                    help="store sliding-window layers (Gemma 2/3, gpt-oss, Mistral, Qwen2 with "
                         "use_sliding_window) whole. By default each keeps only its window: a "
                         "request reserves ceil((window + --prefill-chunk - 1) / --block-size) "
                         "+ 1 blocks for such a layer, at most its whole length, so more "
                         "requests fit; a model with such layers then reuses no prefix "
                         "(--prefix-file and --redis need this option)")
    ap.add_argument("--default-max-tokens", type=int, default=256,
                    help="chat completions' max_tokens when a request sets none (256)")
    ap.add_argument("--max-body", type=int, default=1 << 20,
                    help="largest request body in bytes; beyond it 413 (1 MiB)")
    ap.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds running requests get to finish after SIGTERM (30)")
    ap.add_argument("--prefix-file", default=None, metavar="PATH",
                    help="load the prefix cache from PATH at start (a file of another model, "
                         "geometry or dtype, or a damaged one, is logged and the server starts "
                         "empty) and save it there atomically at shutdown, after the running "
                         "requests drain")
    ap.add_argument("--prefix-save-interval", type=float, default=None, metavar="S",
                    help="with --prefix-file: also save every S seconds")
    ap.add_argument("--model-fingerprint", default=None, metavar="ID",
                    help="the model's identity for --prefix-file and --redis (any text: a "
                         "checkpoint's commit hash, say); default: ferrox_kv.hf.fingerprint, "
                         "a hash of the config and every weight at start (a second or two per "
                         "GB of weights). Give the same ID only to the same weights")
    ap.add_argument("--redis", default=None, metavar="URL",
                    help="share prefixes through Redis: redis://HOST:PORT/DB (one server) or "
                         "redis+cluster://HOST:PORT (a Redis Cluster, through any node); "
                         "published prefixes are written through, a prompt whose prefix is in "
                         "Redis but not in the pool is read through before its prefill")
    ap.add_argument("--redis-namespace", default="ferrox",
                    help="the first part of every Redis key (ferrox)")
    ap.add_argument("--redis-timeout", type=float, default=0.5,
                    help="seconds each Redis call may take; past it the call is a miss (0.5)")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="threads of torch and of ferrox_kv's attention (torch.set_num_threads "
                         "and ferrox_kv.set_num_threads; default: each one's own)")
    ap.add_argument("--make-tiny", action="store_true",
                    help="first write a tiny random Llama and tokenizer at MODEL_DIR if it does "
                         "not exist (ferrox_kv.serve.tiny), to try the server offline")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--log-level", default="warning",
                    choices=("critical", "error", "warning", "info", "debug"))


def load(args):
    """(model, tokenizer, pool) from the arguments; nothing is downloaded."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ferrox_kv.hf  # noqa: F401  (registers the "ferrox" attention)
    from ferrox_kv import KvBlockPool
    from ferrox_kv.hf import ATTENTION, kv_geometry

    if args.make_tiny and not os.path.exists(args.model_dir):
        from ferrox_kv.serve.tiny import make_model_dir
        make_model_dir(args.model_dir)
    check_model_dir(args)
    if args.torch_threads is not None:
        if args.torch_threads < 1:
            raise SystemExit(f"ferrox-kv serve: --torch-threads must be >= 1, got {args.torch_threads}")
        torch.set_num_threads(args.torch_threads)
        ferrox_kv.set_num_threads(args.torch_threads)
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, attn_implementation=ATTENTION,
        dtype="auto" if args.dtype == "auto" else getattr(torch, args.dtype),
        local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
    n_layers, n_kv, head_dim = kv_geometry(model.config)
    if args.block_size < 1:
        raise SystemExit("ferrox-kv serve: --block-size must be >= 1")
    kv_dtype = model_dtype(model) if args.kv_dtype == "auto" else args.kv_dtype
    block_bytes = KvBlockPool(args.block_size, 0, n_kv, head_dim, dtype=kv_dtype).block_bytes
    blocks = args.kv_blocks
    if blocks is None:
        blocks = int((args.kv_gib if args.kv_gib is not None else 0.5) * (1 << 30) // block_bytes)
    if blocks < n_layers:
        raise SystemExit(f"ferrox-kv serve: a pool of {blocks} blocks cannot hold one position "
                         f"of {n_layers} layers; raise --kv-blocks or --kv-gib")
    pool = KvBlockPool(args.block_size, blocks, n_kv, head_dim,
                       prefix_cache=not args.no_prefix_cache, dtype=kv_dtype)
    return model, tokenizer, pool


def model_dtype(model) -> str:
    """The dtype the model's weights were loaded in, as a name of ``DTYPES``
    (a dtype the pool cannot store is refused, naming ``--dtype``)."""
    name = str(model.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise SystemExit(f"ferrox-kv serve: the checkpoint loads as {name}; pass --dtype "
                         f"{' or '.join(DTYPES)}")
    return name


def prefixes(args, model, pool, metrics):
    """(PrefixFile or None, RedisPrefixes or None) for ``--prefix-file`` and
    ``--redis``; the file is loaded here, before any request. The model's
    fingerprint (a hash of its config and every weight, or
    ``--model-fingerprint``) is computed once, only when one of them is
    asked for."""
    if args.prefix_file is None and args.redis is None:
        return None, None
    from ferrox_kv.hf import fingerprint, kv_geometry, layer_windows
    if not args.no_sliding_windows and any(w is not None for w in layer_windows(model.config)):
        raise SystemExit("ferrox-kv serve: --prefix-file and --redis reuse prefixes, which this "
                         "model's sliding-window layers cannot (their windows give back the "
                         "blocks a prefix hit would share); add --no-sliding-windows to store "
                         "them whole")
    from ferrox_kv.serve.prefixes import PrefixFile, RedisPrefixes
    fp = (args.model_fingerprint.encode() if args.model_fingerprint is not None
          else fingerprint(model))
    n_layers = kv_geometry(model.config)[0]
    files = redis = None
    if args.prefix_file is not None:
        if not pool.prefix_cache:
            raise SystemExit("ferrox-kv serve: --prefix-file needs the prefix cache; drop "
                             "--no-prefix-cache")
        files = PrefixFile(pool, args.prefix_file, fp, n_layers)
        files.load()
        metrics.prefix_file = files
    if args.redis is not None:
        if not pool.prefix_cache:
            raise SystemExit("ferrox-kv serve: --redis needs the prefix cache; drop "
                             "--no-prefix-cache")
        if not args.redis_timeout > 0:
            raise SystemExit("ferrox-kv serve: --redis-timeout takes seconds > 0")
        try:
            redis = RedisPrefixes(pool, args.redis, fingerprint=fp, n_layers=n_layers,
                                  namespace=args.redis_namespace, timeout=args.redis_timeout)
        except (ValueError, TypeError, ImportError) as e:
            raise SystemExit(f"ferrox-kv serve: --redis {args.redis}: {e}")
        redis.on_fetch = metrics.redis_fetch
        metrics.redis = redis
    return files, redis


def check_model_dir(args):
    """Stops (before torch is imported) when MODEL_DIR is not a directory,
    saying what to pass."""
    if not os.path.isdir(args.model_dir) and not (args.make_tiny
                                                  and not os.path.exists(args.model_dir)):
        raise SystemExit(f"ferrox-kv serve: {args.model_dir!r} is not a directory; pass the path "
                         "of a checkpoint saved with save_pretrained (model and tokenizer), or "
                         "add --make-tiny to write a tiny random model there first")


def bind(host, port):
    """A listening TCP socket on (host, port), or SystemExit saying why."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise SystemExit(f"ferrox-kv serve: cannot listen on {host}:{port}: {e}")
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise SystemExit(f"ferrox-kv serve: cannot listen on {host}:{port}: {e.strerror or e}"
                         + ("; another process holds the port: pass another --port"
                            if e.errno == errno.EADDRINUSE else ""))
    sock.set_inheritable(True)
    return sock


def run(args) -> int:
    check_model_dir(args)
    try:
        import uvicorn

        from ferrox_kv.serve.app import make_app
        from ferrox_kv.serve.engine import Engine, check_options
        from ferrox_kv.serve.metrics import Metrics
    except ImportError as e:
        print(f"ferrox-kv serve needs FastAPI, uvicorn and prometheus_client: "
              f"pip install '.[serve]' from the ferrox_kv checkout ({e})",
              file=sys.stderr)
        return 2
    try:
        check_options(mode=args.mode, max_batch=args.max_batch, max_queue=args.max_queue,
                      queue_timeout=args.queue_timeout, prefill_chunk=args.prefill_chunk,
                      threads_cache=args.threads_cache, cli=True)
    except ValueError as e:
        print(f"ferrox-kv serve: {e}", file=sys.stderr)
        return 2
    if args.prefix_save_interval is not None and (args.prefix_file is None
                                                  or args.prefix_save_interval <= 0):
        print("ferrox-kv serve: --prefix-save-interval takes seconds > 0, with --prefix-file",
              file=sys.stderr)
        return 2
    sock = bind(args.host, args.port)          # before the model: a busy port says so at once
    model, tokenizer, pool = load(args)
    metrics = Metrics(pool)
    files, redis = prefixes(args, model, pool, metrics)
    engine = Engine(model, tokenizer, pool, mode=args.mode, max_batch=args.max_batch,
                    max_queue=args.max_queue, queue_timeout=args.queue_timeout,
                    prefill_chunk=args.prefill_chunk, threads_cache=args.threads_cache,
                    metrics=metrics, fetch=None if redis is None else redis.fetch,
                    sliding_windows=not args.no_sliding_windows)
    metrics.engine = engine
    name = os.path.basename(os.path.normpath(args.model_dir))
    asgi, _ = make_app(engine, metrics, model_name=name,
                       default_max_tokens=args.default_max_tokens, max_body=args.max_body,
                       info={"dtype": model_dtype(model), "kv_dtype": pool.dtype})
    saver = None
    if files is not None and args.prefix_save_interval:
        saver = files.save_every(args.prefix_save_interval)

    class Server(uvicorn.Server):
        draining = False
        forced = False

        def handle_exit(self, sig, frame):
            if self.draining:                   # a second signal: now, without saving
                self.forced = True
                return super().handle_exit(sig, frame)
            self.draining = True

            def drain():
                engine.drain(args.shutdown_timeout)
                self.should_exit = True

            threading.Thread(target=drain, name="ferrox-serve-drain", daemon=True).start()

    config = uvicorn.Config(asgi, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.log_level in ("info", "debug"), workers=1,
                            timeout_graceful_shutdown=5, lifespan="off")
    server = Server(config)
    engine.start()
    mode = args.mode + (f", {args.threads_cache} cache" if args.mode == "threads" else "")
    port = sock.getsockname()[1]
    n_sliding = sum(w is not None for w in engine.windows)
    sliding = f", {n_sliding} sliding layers keep their windows" if n_sliding else ""
    print(f"ferrox-kv serve: {name} on http://{args.host}:{port} ({mode} mode, "
          f"{model_dtype(model)} weights, {pool.dtype} KV, "
          f"{pool.total_blocks} blocks of {pool.block_size} positions, prefix cache "
          f"{'on' if engine.reuse_prefixes else 'off'}{sliding}"
          f"{', Redis ' + args.redis if redis is not None else ''})", file=sys.stderr, flush=True)
    # shutdown: stop admitting and drain (handle_exit), then save the prefix
    # file, then check the pool; a second signal skips the save. Either way
    # an interval save under way is waited for (it is bounded: one export,
    # one file write): it holds references on published blocks while it
    # exports, and the check below must see none in use
    try:
        server.run(sockets=[sock])
    finally:
        if saver is not None:
            saver.stop()
        engine.close()
        sock.close()
        if redis is not None:
            redis.close()
    if files is not None and not server.forced:
        files.save()
    stats = pool.stats()
    try:
        pool.check()
    except Exception as e:
        print(f"ferrox-kv serve: pool.check() failed at exit: {e}", file=sys.stderr, flush=True)
        return 1
    if stats["used_blocks"]:
        print(f"ferrox-kv serve: {stats['used_blocks']} blocks still in use at exit",
              file=sys.stderr, flush=True)
        return 1
    print(f"ferrox-kv serve: stopped; pool.check() passed, used_blocks=0, "
          f"cached_blocks={stats['cached_blocks']}", file=sys.stderr, flush=True)
    return 0


def main(argv=None, prog="ferrox-kv serve") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))
