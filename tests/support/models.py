"""Tiny random transformers models built from configs (nothing downloaded),
and the prompts the hf tests feed them."""
VOCAB = 256


def config(arch, layers=None):
    """The tiny config of ``arch`` ("llama", "qwen2" or "mistral", whose
    sliding window of 8 is shorter than the tests' sequences) and its model
    class; ``layers`` overrides the number of layers."""
    import transformers
    common = dict(vocab_size=VOCAB, intermediate_size=128, max_position_embeddings=512)
    if arch == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                       num_key_value_heads=2, **common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(hidden_size=96, num_hidden_layers=2, num_attention_heads=6,
                                       num_key_value_heads=3, **common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "mistral":
        cfg = transformers.MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=1, sliding_window=8, **common)
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(f"no tiny config for {arch!r}")
    if layers is not None:
        cfg.num_hidden_layers = layers
    return cfg, cls


def prompt(n=12, seed=0, batch=1):
    """``batch`` rows of ``n`` token ids in 1..VOCAB-1, from ``seed``."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, n), generator=g)
