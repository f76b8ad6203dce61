"""The explorer's page holds what the analysis functions compute, for the project's example models."""

import json
import re

import explorer_models
import pytest
import torch
from torch.nn import functional as F

from mumoe_tn.analysis import ablate, explore, mumoe_layers
from mumoe_tn.analysis.outputs import logits_of


def _captured(model, data, batch_size=None):
    """Every layer's coefficients per mode, recorded here by a hook over the whole data in one pass."""
    captured = {}

    def record(name):
        def hook(module, args, output):
            captured[name] = module.last_coefficients

        return hook

    handles = [layer.register_forward_hook(record(name)) for name, layer in mumoe_layers(model).items()]
    with torch.no_grad():
        model(data)
    for handle in handles:
        handle.remove()
    return captured


def _check_examples(report, captured, threshold):
    """Each unit's examples are the largest of its recorded coefficients, at their own (sample, position)."""
    for layer in report.data["layers"]:
        coefficients = captured[layer["name"]]
        for unit in layer["units"]:
            a = coefficients[unit["mode"]][..., unit["index"]]
            a = a.reshape(a.shape[0], -1).double()
            active = a[a >= threshold]
            expected = active.sort(descending=True).values[: report.data["top_k"]]
            values = [ex["value"] for ex in unit["examples"]]
            assert values == pytest.approx(expected.tolist(), rel=1e-3, abs=1e-6), (layer["name"], unit["label"])
            for ex in unit["examples"]:
                assert a[ex["sample"], ex["position"]].item() == pytest.approx(ex["value"], rel=1e-3, abs=1e-6)
            assert unit["dead"] == (active.numel() == 0)
            assert sum(unit["histogram"]) == unit["load"] == active.numel()
        for e, mode in enumerate(layer["modes"]):
            a = coefficients[e].reshape(-1, coefficients[e].shape[-1])
            assert mode["dead"] == ((a >= threshold).sum(0) == 0).nonzero().flatten().tolist()


def _next_token_loss(model, data):
    logits = logits_of(model(data))
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), data[:, 1:].flatten()).item()


def test_char_gpt_report_matches_the_recorded_coefficients_and_ablations(char_report):
    model, data, report, chars = char_report.model, char_report.data, char_report.report, char_report.vocabulary
    captured = _captured(model, data)
    _check_examples(report, captured, 1e-6)
    subset = data[:6]
    with torch.no_grad():
        intact = _next_token_loss(model, subset)
        for layer in report.data["layers"]:
            block = mumoe_layers(model)[layer["name"]]
            for unit in layer["units"][:4]:
                with ablate(block, tuple(unit["unit"])):
                    ablated = _next_token_loss(model, subset)
                assert unit["ablation"]["delta_loss"] == pytest.approx(ablated - intact, rel=1e-3, abs=1e-6)
    first = report.data["layers"][0]["units"][0]["examples"][0]
    centre = first["tokens"][first["centre"]]
    assert centre[0] == chars[data[first["sample"], first["position"]]]  # the example's own token, in context
    assert centre[1] == pytest.approx(first["value"], rel=1e-2)
    html = char_report.page.read_text(encoding="utf-8")
    payload = re.search(r'<script type="application/json" id="explorer-data">(.*?)</script>', html, re.S).group(1)
    assert json.loads(payload) == json.loads(json.dumps(report.data))  # the page carries exactly the findings


def test_digits_report_has_images_classes_and_per_class_ablation(digits_report):
    model, data, report = digits_report.model, digits_report.data, digits_report.report
    labels, images = digits_report.labels, digits_report.images
    _check_examples(report, _captured(model, data), 1e-6)
    assert report.data["kind"] == "classes" and report.data["image_shape"] == [8, 8]
    layer = report.data["layers"][0]
    block = mumoe_layers(model)[layer["name"]]
    x, y = data[:8], labels[:8]
    with torch.no_grad():
        for unit in layer["units"][:3]:
            with ablate(block, tuple(unit["unit"])):
                predictions = model(x).argmax(-1)
            for row in unit["ablation"]["classes"]:
                chosen = y == int(row["class"])
                assert row["ablated"] == pytest.approx((predictions[chosen] == y[chosen]).double().mean().item())
            for ex in unit["examples"]:
                image = images[ex["sample"]]
                assert ex["label"] == str(int(labels[ex["sample"]]))
                scaled = ((image - image.min()) / (image.max() - image.min()) * 255).round().flatten()
                assert report.data["images"][str(ex["sample"])] == pytest.approx(scaled.tolist())
    changed = [u["ablation"]["changed"] for u in layer["units"]]
    assert all("polysemanticity" in u["ablation"] for u in layer["units"])
    assert (layer["polysemanticity"] is None) == (not any(changed))


def test_converted_gpt2_report_has_hierarchical_slices(gpt2_report):
    model, data, report = gpt2_report.model, gpt2_report.data, gpt2_report.report
    _check_examples(report, _captured(model, data), 1e-6)
    layer = report.data["layers"][0]
    assert [u["label"] for u in layer["units"]][:4] == ["(0, ·)", "(1, ·)", "(2, ·)", "(·, 0)"]
    assert len(layer["units"]) == 3 + 4 and len(layer["joint"]) == 1
    joint = torch.tensor(layer["joint"][0])
    assert joint.shape == (3, 4)
    a = _captured(model, data)[layer["name"]]
    expected = (a[0].reshape(-1, 3).double().T @ a[1].reshape(-1, 4).double()) / a[0].reshape(-1, 3).shape[0]
    torch.testing.assert_close(joint.double(), expected, rtol=1e-4, atol=1e-6)
    block = mumoe_layers(model)[layer["name"]]
    with torch.no_grad():
        intact = _next_token_loss(model, data[:4])
        with ablate(block, (None, 2)):
            ablated = _next_token_loss(model, data[:4])
    unit = next(u for u in layer["units"] if u["unit"] == [None, 2])
    assert unit["ablation"]["delta_loss"] == pytest.approx(ablated - intact, rel=1e-3, abs=1e-6)


def test_explore_rejects_bad_input_before_any_work(tmp_path):
    model, data, _chars = explorer_models.char_gpt(sequences=2)
    with pytest.raises(ValueError, match=r"without labels: give integer token ids"):
        explore(model, data.double(), progress=False)
    with pytest.raises(ValueError, match=r"labels must have shape \(2,\)"):
        explore(model, data, labels=torch.tensor([0, 1, 2]), progress=False)
    with pytest.raises(ValueError, match=r"no μMoE layer named \['nope'\]"):
        explore(model, data, layers=["nope"], progress=False)
    with pytest.raises(ValueError, match=r"its folder does not exist"):
        explore(model, data, tmp_path / "missing" / "page.html", progress=False)
    with pytest.raises(TypeError, match=r"top_k must be an int"):
        explore(model, data, top_k=2.5, progress=False)
