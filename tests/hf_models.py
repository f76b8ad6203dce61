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


def gpt_neox(*, vocab=256, **config):
    """A two-layer ``GPTNeoXForCausalLM`` (Pythia) of width 32: a plain MLP ``dense_h_to_4h, dense_4h_to_h``."""
    settings = transformers.GPTNeoXConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, **config,
    )  # fmt: skip
    return transformers.GPTNeoXForCausalLM(settings)


def char_tokenizer(alphabet):
    """A fast tokenizer of one token per character of ``alphabet`` (id 0 for any other), built locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{char: index + 1 for index, char in enumerate(sorted(set(alphabet)))}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
