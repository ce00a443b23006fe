"""What the server tests share: a model directory made offline
(``ferrox_kv.serve.tiny``: a tiny random Llama saved with save_pretrained, a
byte-level BPE tokenizer trained with the ``tokenizers`` library, wrapped in
PreTrainedTokenizerFast, with a chat template) and a real ``python -m
ferrox_kv.serve`` process on a free loopback port (``ferrox_kv.serve._process``,
which the load test uses too)."""
from __future__ import annotations

from ferrox_kv.serve._process import ServerProcess, rss_kib  # noqa: F401
from ferrox_kv.serve.tiny import CHAT_TEMPLATE, SYSTEM, TEXT, make_model_dir  # noqa: F401


def Server(model_dir, workdir, *args, start_timeout=180):
    """The server on ``model_dir`` with ``args``, run in ``workdir``."""
    return ServerProcess(model_dir, *args, workdir=workdir, start_timeout=start_timeout)


def greedy_new_ids(model, ids, max_tokens):
    """The ids ``model.generate`` adds to ``ids`` greedily with DynamicCache
    (the reference every serving test compares against)."""
    import torch
    from transformers import DynamicCache
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                             dtype=torch.long), max_new_tokens=max_tokens, do_sample=False,
                             cache=DynamicCache(config=model.config))
    return out[0, len(ids):].tolist()
