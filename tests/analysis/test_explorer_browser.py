"""The explorer's page in a real browser: headless Chromium renders it at 1280 and 760 pixels wide.

A probe added to a copy of the page records script errors, console errors and warnings and any
request the page's Content-Security-Policy blocks, then measures the rendered boxes: nothing may
stick out of the page or of a clipping box, and no two laid-out siblings may overlap. Chromium
prints the DOM (with the probe's findings) and takes a screenshot in the same run.
"""

import json
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
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


def test_char_gpt_page_renders_cleanly_at_both_widths(char_report, tmp_path):
    report = char_report.report
    _check_self_contained(char_report.page.read_text(encoding="utf-8"))
    layer = report.data["layers"][1]
    busiest = max(layer["units"], key=lambda u: u["load"])
    views = {"overview": "layer=0", "expert": f"layer=1&unit={busiest['id']}"}
    rendered = _render_all(char_report.page, views, tmp_path)
    for (fragment, width), (_, probe, screenshot) in rendered.items():
        assert probe["ready"] and probe["problems"] == [], (fragment, width, probe["problems"])
        assert _png_size(screenshot) == (width, 1400)
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


def test_digits_expert_page_renders_images_cleanly(digits_report, tmp_path):
    _check_self_contained(digits_report.page.read_text(encoding="utf-8"))
    unit = digits_report.report.data["layers"][0]["units"][3]
    rendered = _render_all(digits_report.page, {"digits": "layer=0&unit=3"}, tmp_path)
    for (fragment, width), (dom, probe, _) in rendered.items():
        assert probe["problems"] == [], (fragment, width, probe["problems"])
        assert dom.count("<canvas") == len(unit["examples"]) and "accuracy" in dom


def test_hierarchical_gpt2_overview_renders_cleanly(gpt2_report, tmp_path):
    _check_self_contained(gpt2_report.page.read_text(encoding="utf-8"))
    for (fragment, width), (dom, probe, _) in _render_all(gpt2_report.page, {"gpt2": "layer=0"}, tmp_path).items():
        assert probe["problems"] == [], (fragment, width, probe["problems"])
        assert "Hierarchical view" in dom and dom.count("<rect") >= 3 * 4


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
