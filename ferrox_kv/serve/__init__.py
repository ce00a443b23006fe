"""``ferrox-kv serve``: an OpenAI-compatible server whose KV lives in one
ferrox_kv pool.

    ferrox-kv serve MODEL_DIR [--kv-gib N | --kv-blocks N] [--block-size 16]
        [--dtype float32] [--mode batch|threads] [--max-batch N] [--max-queue N]
        [--queue-timeout S] [--host 127.0.0.1] [--port 8000]

Modules, as vLLM splits ``entrypoints/openai/``: ``protocol`` (the request
bodies and the errors), ``app`` (the FastAPI routes as module functions over
an ``AppState``, streaming), ``requests`` (``Request``, ``Sampling``),
``text`` (the incremental detokenizer, stop strings and the stream's
hold-back; no model needed), ``engine`` (admission, the FIFO queue and the
continuous-batching step loop; the one place that checks its options; the
packed step's cache is ``ferrox_kv.hf.PackedCache``), ``metrics``
(Prometheus), ``cli`` (arguments, loading, uvicorn, graceful shutdown).
Needs ``pip install '.[serve]'`` (FastAPI, uvicorn,
prometheus_client, with torch and transformers); the rest of ferrox_kv never
imports this package.
"""
