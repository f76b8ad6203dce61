"""Small Hugging Face models built from local configs (nothing downloaded), with dropout off."""

import transformers


def gpt2(*, layers=2, width=64, heads=4, vocab=100, positions=64, **config):
    """A ``GPT2LMHeadModel``; extra keywords go to its config (e.g. ``bos_token_id``)."""
    options = {"n_layer": layers, "n_embd": width, "n_head": heads, "vocab_size": vocab, "n_positions": positions}
    settings = transformers.GPT2Config(**options, **config)
    settings.resid_pdrop = settings.embd_pdrop = settings.attn_pdrop = 0.0
    return transformers.GPT2LMHeadModel(settings)


def llama(*, vocab=100, **config):
    """A two-layer ``LlamaForCausalLM`` of width 32 (grouped-query attention, 4 heads over 2)."""
    settings = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, **config,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(settings)
