"""``ferrox-kv serve``: an OpenAI-compatible server whose KV lives in one
ferrox_kv pool.

    ferrox-kv serve MODEL_DIR [--kv-gib N | --kv-blocks N] [--block-size 16]
        [--dtype float32] [--mode batch|threads] [--max-batch N] [--max-queue N]
        [--queue-timeout S] [--host 127.0.0.1] [--port 8000]

Modules: ``engine`` (admission, the FIFO queue and the continuous-batching
step loop), ``text`` (the incremental detokenizer, stop strings and the
stream's hold-back; no model needed), ``app`` (the FastAPI routes,
streaming, errors), ``metrics``
(Prometheus), ``cli`` (arguments, loading, uvicorn, graceful shutdown).
Needs ``pip install '.[serve]'`` (FastAPI, uvicorn,
prometheus_client, with torch and transformers); the rest of ferrox_kv never
imports this package.
"""
