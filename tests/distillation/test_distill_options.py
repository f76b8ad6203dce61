"""distill's options as one object or as keywords: the same run, one form at a time."""

import dataclasses

import pytest
import torch
from torch import nn

from mumoe_tn.distillation import DistillOptions
from mumoe_tn.distillation.training import distill
from mumoe_tn.distillation.transcoders import Transcoder


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        return h + self.mlp(h)


def _batches():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 32, (4, 16), generator=generator) for _ in range(6)]


FACTORIES = {"tc": lambda block: Transcoder(block.in_features, 16, block.out_features, k=2)}


def test_options_and_keywords_run_the_same_distillation():
    model = TinyLM()
    options = DistillOptions(tokens=256, batch_size=32, buffer_tokens=128, seed=3, recipe="plain", progress=False)
    by_object = distill(model, _batches(), FACTORIES, options=options)
    by_keywords = distill(model, _batches(), FACTORIES, **{f.name: getattr(options, f.name)
                                                          for f in dataclasses.fields(options)})  # fmt: skip
    assert by_object.tokens == by_keywords.tokens == 256
    first, second = by_object.replacements["mlp"]["tc"], by_keywords.replacements["mlp"]["tc"]
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    other = distill(model, _batches(), FACTORIES, options=dataclasses.replace(options, seed=4))
    assert not torch.equal(other.replacements["mlp"]["tc"].encoder.weight, first.encoder.weight)


def test_keywords_beside_options_are_refused_by_name():
    options = DistillOptions(tokens=64, progress=False)
    with pytest.raises(TypeError, match=r"not both: got options= and \['batch_size', 'seed'\]"):
        distill(TinyLM(), _batches(), FACTORIES, options=options, seed=1, batch_size=32)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: distill(TinyLM(), _batches(), FACTORIES, tokens=64, batch_sise=32),
            r"unknown options \['batch_sise'\]",
        ),
        (lambda: distill(TinyLM(), _batches(), FACTORIES, batch_size=32), "needs tokens="),
        (lambda: distill(TinyLM(), _batches(), FACTORIES, options={"tokens": 64}), "options must be a DistillOptions"),
    ],
)
def test_a_misused_option_is_a_clear_type_error(call, message):
    with pytest.raises(TypeError, match=message):
        call()
