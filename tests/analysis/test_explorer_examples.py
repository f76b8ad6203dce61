"""Each example's ``explorer`` function (what ``mumoe-tn explore examples/…:explorer`` calls), in miniature."""

import sys
from pathlib import Path

import pytest
import torch

from mumoe_tn.analysis import explore

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")


@pytest.fixture
def examples(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    torch.manual_seed(0)


@pytest.mark.parametrize(
    ("module", "options", "kind"),
    [
        ("char_gpt", {"steps": 2, "sequences": 3, "width": 16}, "text"),
        ("mixer_digits", {"epochs": 1}, "classes"),
        ("gpt2_upcycle", {"experts": (2, 3), "steps": 2, "sequences": 2}, "text"),
    ],
)
def test_example_explorers_build_what_explore_takes(examples, module, options, kind, tmp_path):
    if module == "mixer_digits":
        pytest.importorskip("sklearn")
    if module == "gpt2_upcycle":
        pytest.importorskip("transformers")
    built = __import__(module).explorer(**options)
    assert {"model", "data", "title"} <= set(built)
    data = built.pop("data")
    if kind == "classes":  # a few test digits are enough here
        data, built["labels"], built["images"] = data[:12], built["labels"][:12], built["images"][:12]
    report = explore(built.pop("model"), data, tmp_path / "page.html", **built, top_k=2, ablation=False, progress=False)
    assert report.data["kind"] == kind and (tmp_path / "page.html").stat().st_size > 0
    assert all(unit["examples"] or unit["dead"] for layer in report.data["layers"] for unit in layer["units"])
    sys.modules.pop(module, None)
