"""The explorer's page for the project's example models: its content, and how a real browser renders it.

Each page is built once per module (the char GPT, the digits mixer and an upcycled GPT-2) and
checked against the analysis functions: the top examples are the largest recorded
coefficients, the ablation effects equal ablating by hand. Then headless Chromium renders it at
1280 and 760 pixels wide. A probe added to a copy of the page records script errors, console
errors and warnings and any request the page's Content-Security-Policy blocks, then measures
the rendered boxes: nothing may stick out of the page or of a clipping box, and no two laid-out
siblings may overlap. Chromium prints the DOM (with the probe's findings) and takes a screenshot
in the same run.
"""

import json
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import explorer_models
import pytest
import torch
from torch.nn import functional as F

from mumoe_tn.analysis import Exploration, ablate, explore, mumoe_layers
from mumoe_tn.analysis.outputs import logits_of


@dataclass
class Built:
    model: torch.nn.Module
    data: torch.Tensor
    report: Exploration
    page: object
    labels: torch.Tensor | None = None
    images: torch.Tensor | None = None
    vocabulary: list | None = None


@pytest.fixture(scope="module")
def char_report(tmp_path_factory):
    model, data, chars = explorer_models.char_gpt(sequences=10)
    page = tmp_path_factory.mktemp("char") / "char.html"
    report = explore(
        model, data, page, vocabulary=chars, top_k=5, context=4, batch_size=5, ablation_samples=6, progress=False
    )
    return Built(model, data, report, page, vocabulary=chars)


@pytest.fixture(scope="module")
def digits_report(tmp_path_factory):
    pytest.importorskip("sklearn")
    model, data, labels, images = explorer_models.digits(samples=16)
    page = tmp_path_factory.mktemp("digits") / "digits.html"
    report = explore(
        model, data, page, labels=labels, images=images, layers=["layers.1.token_mlp", "layers.1.channel_mlp"],
        top_k=6, ablation_samples=8, batch_size=8, progress=False,
    )  # fmt: skip
    return Built(model, data, report, page, labels=labels, images=images)


@pytest.fixture(scope="module")
def gpt2_report(tmp_path_factory):
    pytest.importorskip("transformers")
    model, data = explorer_models.gpt2(sequences=4)
    page = tmp_path_factory.mktemp("gpt2") / "gpt2.html"
    report = explore(model, data, page, vocabulary=chr, top_k=3, ablation_samples=4, progress=False)
    return Built(model, data, report, page)


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


def _non_overlapping(a, threshold, top_k, context):
    """The largest coefficients of ``a`` (samples, positions), skipping any within 2·context of a kept one."""
    order = sorted(
        ((a[s, p].item(), s, p) for s in range(a.shape[0]) for p in range(a.shape[1]) if a[s, p] >= threshold),
        reverse=True,
    )
    kept = []
    for value, sample, position in order:
        if context is None or all(s != sample or abs(p - position) > 2 * context for _, s, p in kept):
            kept.append((value, sample, position))
    return [value for value, _, _ in kept[:top_k]]


def _check_examples(report, captured, threshold, context=None):
    """Each unit's examples are the largest of its recorded coefficients, at their own (sample, position).

    With ``context`` (text), no two windows of one sequence overlap: a coefficient within
    ``2·context`` positions of a larger one kept is passed over.
    """
    for layer in report.data["layers"]:
        coefficients = captured[layer["name"]]
        for unit in layer["units"]:
            a = coefficients[unit["mode"]][..., unit["index"]]
            a = a.reshape(a.shape[0], -1).double()
            active = a[a >= threshold]
            expected = torch.tensor(_non_overlapping(a, threshold, report.data["top_k"], context))
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
    _check_examples(report, captured, 1e-6, context=4)
    for layer in report.data["layers"]:
        for unit in layer["units"]:
            by_sample = {}
            for ex in unit["examples"]:
                by_sample.setdefault(ex["sample"], []).append(ex["position"])
            for positions in by_sample.values():  # windows of ±4 tokens: starts at least 9 apart
                assert all(abs(p - q) > 8 for i, p in enumerate(positions) for q in positions[:i]), unit["label"]
            assert all(delta > 0 for _, delta, _ in unit["ablation"]["hurt"]), unit["label"]  # only rises
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
    _check_examples(report, _captured(model, data), 1e-6, context=12)
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


# The page in a browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no headless browser: install the Debian package 'chromium' (apt-get install chromium)"
)

WIDTHS = (1280, 760)

HERE = Path(__file__).resolve().parent
WATCH = (HERE / "explorer_watch.js").read_text(encoding="utf-8")
PROBE = (HERE / "explorer_probe.js").read_text(encoding="utf-8")


def _probed_copy(page, folder):
    html = page.read_text(encoding="utf-8")
    assert html.count("<head>") == 1 and html.count("</body>") == 1
    probed = folder / ("probed-" + page.name)
    html = html.replace("<head>", f"<head><script>{WATCH}</script>")
    html = html.replace("</body>", f"<script>{PROBE}</script></body>")
    probed.write_text(html, encoding="utf-8")
    return probed


def _render(page, fragment, width, screenshot, profile):
    """Chromium's DOM of ``page#fragment`` at ``width`` pixels, and a screenshot of the window."""
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
        f"--user-data-dir={profile}", f"--window-size={width},1400", f"--screenshot={screenshot}", "--dump-dom",
        f"{page.as_uri()}#{fragment}",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    found = re.search(r'<pre id="probe"[^>]*>(.*?)</pre>', result.stdout, re.S)
    assert found, f"the probe did not run: {result.stdout[-500:]}"
    unescaped = found.group(1).replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"').replace("&amp;", "&")
    return result.stdout, json.loads(unescaped)


def _check_self_contained(html):
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    urls = set(re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"'<>)]*", html))
    assert urls <= {"http://www.w3.org/2000/svg"}, urls  # the SVG namespace is a name, never fetched
    assert not re.search(r"<(?:script|link|img|iframe)[^>]+(?:src|href)=", html)


def _render_all(page, views, folder):
    probed = _probed_copy(page, folder)
    jobs = [
        (probed, fragment, width, folder / f"{label}-{width}.png", folder / f"profile-{label}-{width}")
        for label, fragment in views.items()
        for width in WIDTHS
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda job: _render(*job), jobs))
    return {(job[1], job[2]): (dom, probe, job[3]) for job, (dom, probe) in zip(jobs, results, strict=False)}


def _png_size(path):
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


@needs_chromium
def test_char_gpt_page_renders_cleanly_at_both_widths(char_report, tmp_path):
    report = char_report.report
    _check_self_contained(char_report.page.read_text(encoding="utf-8"))
    layer = report.data["layers"][1]
    busiest = max(layer["units"], key=lambda u: u["load"])
    # a layer by its module path, or by its position (older links)
    views = {"overview": "layer=0", "expert": f"layer={layer['name']}&unit={busiest['id']}"}
    rendered = _render_all(char_report.page, views, tmp_path)
    for (fragment, width), (_, probe, screenshot) in rendered.items():
        assert probe["ready"] and probe["problems"] == [], (fragment, width, probe["problems"])
        assert _png_size(screenshot) == (width, 1400)
        assert probe["clicked"] == f"#layer={layer['name']}"  # the last layer's button: its module path
    dom, probe, _ = rendered[("layer=0", 1280)]
    first = report.data["layers"][0]
    assert probe["title"].endswith(first["name"])
    assert dom.count('data-unit="') == len(first["units"])  # every expert listed in the sidebar
    assert "dead experts" in dom and "Expert usage" in dom
    dom, probe, _ = rendered[(views["expert"], 760)]
    assert probe["title"].endswith(f"{layer['name']} {busiest['label']}")
    assert f"Top {len(busiest['examples'])} activating tokens in context" in dom
    assert dom.count('class="example"') == len(busiest["examples"])
    assert dom.count('class="tok centre"') == len(busiest["examples"])  # one highlighted token per example
    assert "Effect of ablating it" in dom


@needs_chromium
def test_digits_expert_page_renders_images_cleanly(digits_report, tmp_path):
    _check_self_contained(digits_report.page.read_text(encoding="utf-8"))
    unit = digits_report.report.data["layers"][0]["units"][3]
    rendered = _render_all(digits_report.page, {"digits": "layer=0&unit=3"}, tmp_path)
    for (fragment, width), (dom, probe, _) in rendered.items():
        assert probe["problems"] == [], (fragment, width, probe["problems"])
        samples = {ex["sample"] for ex in unit["examples"]}  # one image per sample, its top rows listed
        assert dom.count("<canvas") == len(samples) and "accuracy" in dom


@needs_chromium
def test_hierarchical_gpt2_overview_renders_cleanly(gpt2_report, tmp_path):
    _check_self_contained(gpt2_report.page.read_text(encoding="utf-8"))
    for (fragment, width), (dom, probe, _) in _render_all(gpt2_report.page, {"gpt2": "layer=0"}, tmp_path).items():
        assert probe["problems"] == [], (fragment, width, probe["problems"])
        assert "Hierarchical view" in dom and dom.count("<rect") >= 3 * 4


@needs_chromium
def test_the_probe_catches_overlaps_and_cut_off_text(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text(
        "<!DOCTYPE html><html><head></head><body data-ready='true'>"
        "<div style='height:40px'>first</div><div style='margin-top:-30px;height:40px'>second</div>"
        "<div style='width:60px;overflow:hidden;white-space:nowrap'>a long line of text that is cut off</div>"
        "<script>console.error('boom')</script></body></html>",
        encoding="utf-8",
    )
    (_dom, probe, _), *_ = _render_all(page, {"broken": ""}, tmp_path).values()
    problems = "\n".join(probe["problems"])
    assert "overlap: div 'first' and div 'second'" in problems
    assert "cut off: div 'a long line" in problems
    assert "console.error: boom" in problems
