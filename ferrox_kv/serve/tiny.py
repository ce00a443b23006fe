"""A model directory made offline, to try the server and to test it:
``python -m ferrox_kv.serve.tiny DIR`` writes a tiny random Llama (saved
with ``save_pretrained``) and a byte-level BPE tokenizer trained here with
the ``tokenizers`` library (``PreTrainedTokenizerFast``, with a chat
template). The weights are random, so the text is meaningless; the server's
behaviour (batching, admission, streaming, metrics) is what it shows. The
output head gives every token whose text is not printable (a piece of a
multi-byte character, a control byte, ``<s>``, ``<pad>``) a zero row and the
printable ones rows whose logits spread over about +-8 x sqrt(hidden), so
the model writes printable text, greedy or sampled (the byte-level
vocabulary itself still encodes any input).

    python -m ferrox_kv.serve.tiny ./tiny-llama && ferrox-kv serve ./tiny-llama
"""
from __future__ import annotations

import sys

TEXT = """The pool is a bounded set of blocks that request threads share. A request
reserves its worst case when it is admitted, so that decoding can never fail
half way. When the pool is full a request waits in a queue, first in first out,
and after a timeout it is refused with a status that tells the client when to
come back. The prefix cache keeps the blocks of published prompts, so that a
system prompt shared by many requests is computed once. Tenants never share
blocks: the salt keeps their prefixes apart. Attention reads each sequence's
own blocks at its own length, in place, without gathering them first. The quick
brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.
Sphinx of black quartz, judge my vow. How vexingly quick daft zebras jump!
0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' " @ # $ % & _ ~
"""

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>"
                 "{% endif %}")

SYSTEM = ("You are a helpful assistant that answers questions about the KV cache, blocks, "
          "pools and tenants. Keep answers short. ")


def make_model_dir(path, *, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=None,
                   intermediate=None, vocab=320, context=1024, seed=1234, dtype=None):
    """Write a model directory at ``path`` (made if missing) and return its
    path: a random Llama and a byte-level BPE tokenizer trained on ``TEXT``
    (``vocab`` entries at most), with ``CHAT_TEMPLATE``. ``dtype`` (a torch
    dtype or its name): the weights' dtype, saved as the checkpoint's
    ``dtype``; float32 when None."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    cfg = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        max_position_embeddings=context, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    printable_head(model, fast)
    model.generation_config.pad_token_id = fast.pad_token_id
    model.generation_config.eos_token_id = fast.eos_token_id
    if dtype is not None:
        model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    model.save_pretrained(path)
    return str(path)



def _printable(text):
    return bool(text) and "\ufffd" not in text and all(c.isprintable() or c in "\n\t"
                                                       for c in text)


def printable_head(model, tokenizer):
    """Rows of the output head: zero for the tokens whose text is not
    printable, random with a logit spread of about 8 for the rest (the final
    norm's output has a norm of about sqrt(hidden)), so that every token the
    model can be expected to pick, greedy or sampled, prints."""
    import torch
    w = model.lm_head.weight
    special = set(tokenizer.all_special_ids) - {tokenizer.eos_token_id}
    keep = torch.tensor([i not in special and (i == tokenizer.eos_token_id or _printable(
        tokenizer.decode([i]))) for i in range(w.shape[0])])
    with torch.no_grad():
        w.zero_()
        w[keep] = torch.randn(int(keep.sum()), w.shape[1]) * (8.0 / w.shape[1] ** 0.5)


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(prog="python -m ferrox_kv.serve.tiny", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="where to write the model directory")
    ap.add_argument("--bench", action="store_true",
                    help="the hf bench model's geometry (hidden 1024, 2 layers, 32/8 heads x 128)")
    a = ap.parse_args(argv)
    kw = BENCH if a.bench else {}
    print(make_model_dir(a.dir, **kw))
    return 0


# the hf bench model (ferrox_kv/bench/llama.py): 2 layers, 32 query heads over 8
# KV heads x 128, hidden 1024
BENCH = dict(hidden=1024, layers=2, heads=32, kv_heads=8, head_dim=128, intermediate=1024,
             vocab=1024, context=4096)

if __name__ == "__main__":
    sys.exit(main())
