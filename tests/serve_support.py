"""What the server tests share: a model directory made offline (a tiny random
Llama saved with save_pretrained, a byte-level BPE tokenizer trained here
with the ``tokenizers`` library, wrapped in PreTrainedTokenizerFast, with a
chat template) and a real ``python -m ferrox_kv.serve`` process on a free
loopback port."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

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


def make_model_dir(path, *, hidden=64, layers=2, heads=4, kv_heads=2, context=1024, seed=1234):
    """Write a model directory at ``path`` and return it."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    cfg = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=context, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.pad_token_id = fast.pad_token_id
    model.generation_config.eos_token_id = fast.eos_token_id
    model.save_pretrained(path)
    return str(path)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m ferrox_kv.serve MODEL_DIR --port P ARGS...`` run outside
    the checkout (cwd ``workdir``), its output in a log file."""

    def __init__(self, model_dir, workdir, *args, start_timeout=180):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(workdir, f"serve-{self.port}.log")
        self._log = open(self.log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ferrox_kv.serve", model_dir, "--port", str(self.port),
             *map(str, args)], cwd=workdir, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(start_timeout)

    def _wait_ready(self, timeout):
        import httpx

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not come up in {timeout} s:\n{self.log()}")

    def health(self):
        import httpx

        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_idle(self, timeout=60):
        """/health once nothing runs or waits (blocks come back at the
        engine's next step after a client leaves)."""
        end = time.monotonic() + timeout
        while True:
            h = self.health()
            if (h["running"] == 0 and h["waiting"] == 0) or time.monotonic() > end:
                return h
            time.sleep(0.05)

    def log(self):
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, timeout=60):
        """SIGTERM and wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
