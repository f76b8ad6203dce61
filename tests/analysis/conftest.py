"""The explorer's pages for the project's three example models, built once for the content and browser tests."""

from dataclasses import dataclass

import explorer_models
import pytest
import torch

from mumoe_tn.analysis import Exploration, explore


@dataclass
class Built:
    model: torch.nn.Module
    data: torch.Tensor
    report: Exploration
    page: object
    labels: torch.Tensor | None = None
    images: torch.Tensor | None = None
    vocabulary: list | None = None


@pytest.fixture(scope="session")
def char_report(tmp_path_factory):
    model, data, chars = explorer_models.char_gpt(sequences=10)
    page = tmp_path_factory.mktemp("char") / "char.html"
    report = explore(
        model, data, page, vocabulary=chars, top_k=5, context=4, batch_size=5, ablation_samples=6, progress=False
    )
    return Built(model, data, report, page, vocabulary=chars)


@pytest.fixture(scope="session")
def digits_report(tmp_path_factory):
    pytest.importorskip("sklearn")
    model, data, labels, images = explorer_models.digits(samples=16)
    page = tmp_path_factory.mktemp("digits") / "digits.html"
    report = explore(
        model, data, page, labels=labels, images=images, layers=["layers.1.token_mlp", "layers.1.channel_mlp"],
        top_k=6, ablation_samples=8, batch_size=8, progress=False,
    )  # fmt: skip
    return Built(model, data, report, page, labels=labels, images=images)


@pytest.fixture(scope="session")
def gpt2_report(tmp_path_factory):
    pytest.importorskip("transformers")
    model, data = explorer_models.gpt2(sequences=4)
    page = tmp_path_factory.mktemp("gpt2") / "gpt2.html"
    report = explore(model, data, page, vocabulary=chr, top_k=3, ablation_samples=4, progress=False)
    return Built(model, data, report, page)
