"""The project's example models, small and untrained, with data for the explorer tests."""

import sys
from pathlib import Path

import torch

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")


def _examples():
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)


def char_gpt(experts=(16,), sequences=12, context=24):
    """examples/char_gpt.py's transformer (width 32, two blocks) on pydoc_data windows."""
    _examples()
    import char_gpt as example

    from mumoe_tn.layers import MuMoEMLP

    torch.manual_seed(0)
    chars, encoded = example.encoded_corpus()
    model = example.CharGPT(
        len(chars), context, 32, 2, 2,
        lambda: MuMoEMLP(32, 64, 32, experts, "cp", 8, **example.CAUSAL_GATE),
    ).eval()  # fmt: skip
    data = encoded[5000 : 5000 + sequences * context].reshape(sequences, context)
    return model, data, chars


def digits(samples=40):
    """examples/mixer_digits.py's mixer (CP, 16 experts) on the first test digits."""
    _examples()
    import mixer_digits as example

    torch.manual_seed(0)
    model = example.Mixer(example.VARIANTS["CP μMoE (16 experts)"]).eval()
    _, _, images, labels = example.load_digits()
    return model, example.patches(images[:samples]), labels[:samples], images[:samples]


def gpt2(experts=(3, 4), sequences=6, context=16):
    """tests/hf_models.py's small GPT-2 (byte vocabulary) converted to hierarchical CP μMoE blocks."""
    from hf_models import gpt2 as build

    from mumoe_tn.conversion.convert import convert

    torch.manual_seed(0)
    model = build(vocab=256, positions=context, width=32, heads=2).eval()
    convert(model, expert_dims=list(experts), mlps=r"mlp$", decomposition="cp", rank=4)
    text = "The quick brown fox jumps over the lazy dog; pydoc prints the help of a module. " * 4
    data = torch.tensor(list(text.encode()))[: sequences * context].reshape(sequences, context)
    return model.eval(), data
