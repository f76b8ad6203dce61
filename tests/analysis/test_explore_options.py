"""explore's options as one object or as keywords: the same page, one form at a time."""

import dataclasses

import pytest
import torch
from torch import nn

from mumoe_tn.analysis.explorer.explore import explore
from mumoe_tn.analysis.explorer.explore_options import ExploreOptions
from mumoe_tn.layers import MuMoEMLP


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(9, 8), MuMoEMLP(8, 16, 8, 4, "cp", 2), nn.Linear(8, 9)).eval()


def test_options_and_keywords_write_the_same_page():
    data = torch.randint(0, 9, (4, 10), generator=torch.Generator().manual_seed(1))
    options = ExploreOptions(top_k=2, context=3, ablation_samples=2, vocabulary=list("abcdefghi"), progress=False)
    by_object = explore(_model(), data, options=options)
    keywords = {field.name: getattr(options, field.name) for field in dataclasses.fields(options)}
    by_keywords = explore(_model(), data, **keywords)
    assert by_object.data == by_keywords.data
    assert by_object.data["top_k"] == 2
    assert explore(_model(), data, options=dataclasses.replace(options, top_k=1)).data["top_k"] == 1


def test_keywords_beside_options_are_refused_by_name():
    with pytest.raises(TypeError, match=r"not both: got options= and \['context', 'top_k'\]"):
        explore(_model(), torch.zeros(2, 4, dtype=torch.long), options=ExploreOptions(), top_k=3, context=1)
    with pytest.raises(TypeError, match=r"unknown options \['top_kk'\]"):
        explore(_model(), torch.zeros(2, 4, dtype=torch.long), top_kk=3)
    with pytest.raises(TypeError, match="options must be an ExploreOptions"):
        explore(_model(), torch.zeros(2, 4, dtype=torch.long), options={"top_k": 3})


def test_an_option_object_is_checked_as_the_keywords_are():
    with pytest.raises(ValueError, match="top_k"):
        explore(_model(), torch.zeros(2, 4, dtype=torch.long), options=ExploreOptions(top_k=0))
