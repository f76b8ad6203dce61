"""The documentation: its code runs, and the built site shows rendered maths and executed tutorials.

The site is built once per test session (``mkdocs build --strict`` in a subprocess, into a
temporary directory); the build itself executes every ``exec="on"`` block of the pages and fails
on any error or warning.
"""

import ast
import builtins
import importlib.util
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([*ROOT.glob("docs/**/*.md"), ROOT / "README.md"])
#: Plain ```python blocks (not executed by the docs build); ```python exec="on" blocks are.
PLAIN_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
EXEC_BLOCK = re.compile(r'```python [^\n]*exec="on"[^\n]*\n(.*?)```', re.DOTALL)
TUTORIALS = [*sorted(ROOT.glob("docs/tutorials/*.md")), ROOT / "docs" / "cookbook.md"]
#: The README's test install brings the docs extra; a skip names it.
DOCS_MISSING = "the docs extra is not installed: pip install -e '.[test]' (or '.[docs]')"

#: What must never reach a reader: TeX left for a client-side renderer, Sphinx roles.
RAW_TEX = re.compile(r"\$\$|\\\(|\\\[|\$`|`\$|\\(?:frac|sum|mathbb|times|min|in)\b")
SPHINX_ROLE = re.compile(r":(?:class|func|mod|data|meth|attr|obj|exc|ref|math):(?:`|<code>)")


#: The first line of a code block that runs only after the block above it (a reader sees it too).
CONTINUATION = "# continued from the block above\n"
#: Every ```python block, executed or not: (info string after "python", code).
ANY_BLOCK = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def free_names(code: str) -> set[str]:
    """Names a block reads but neither binds nor imports (nor are builtins): what it needs from elsewhere."""
    tree = ast.parse(code)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def test_free_names_sees_what_a_block_needs_from_elsewhere():
    assert free_names("import torch\nx = torch.ones(2)\nprint(x)") == set()
    assert free_names("y = layer(x)") == {"layer", "x"}
    assert free_names("try:\n    f()\nexcept ValueError as error:\n    print(error)") == {"f"}
    assert free_names("def f(a):\n    return a + b\n") == {"b"}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_code_block_stands_alone_or_says_it_continues_the_one_above(page):
    blocks = ANY_BLOCK.findall(page.read_text())
    for number, (info, code) in enumerate(blocks):
        needs = free_names(code)
        if code.startswith(CONTINUATION):
            assert number > 0, f"{page.name}, code block {number} continues a block that is not there"
            assert needs, (
                f"{page.name}, code block {number} says it continues the block above but needs nothing from it"
            )
            previous = blocks[number - 1][0]
            session = re.search(r'session="([^"]+)"', info)
            if "exec=" in info or "exec=" in previous:  # executed at build time: the same session as the block above
                assert session and session.group(0) in previous, f"{page.name}, code block {number}: not in its session"
        else:
            assert not needs, (
                f"{page.name}, code block {number} uses {sorted(needs)} from elsewhere: define them, or start it with "
                f"{CONTINUATION.strip()!r}"
            )


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_plain_code_blocks_run_as_written(page, monkeypatch, tmp_path):
    """Each block in a fresh namespace, unless it says it continues the one above."""
    blocks = PLAIN_BLOCK.findall(page.read_text())
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for number, code in enumerate(blocks):
        if not code.startswith(CONTINUATION):
            namespace = {"__name__": f"docs_{page.stem}_{number}"}
        try:
            exec(compile(code, f"{page.name}[block {number}]", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"{page.name}, code block {number} failed: {error!r}\n{code}") from error


def test_docs_code_is_executed_at_build_time():
    assert len(TUTORIALS) == 4
    for page in TUTORIALS:
        assert EXEC_BLOCK.findall(page.read_text()), f"{page.name} has no executed code block"
    for page in [*TUTORIALS, ROOT / "docs" / "getting-started.md", ROOT / "docs" / "cli.md"]:
        assert not PLAIN_BLOCK.findall(page.read_text()), f"{page.name} has a ```python block the build does not run"


class _Text(HTMLParser):
    """The visible text of a page outside <pre>, <code>, <script>, <style> and <math>."""

    SKIP = frozenset({"pre", "code", "script", "style", "math", "annotation"})

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.parts: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.depth += 1

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.depth -= 1

    def handle_data(self, data):
        if self.depth == 0:
            self.parts.append(data)


def _visible_text(html: str) -> str:
    parser = _Text()
    parser.feed(html)
    return " ".join(parser.parts)


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings", "markdown_katex_rs", "markdown_exec"):
        pytest.importorskip(module, reason=DOCS_MISSING)
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "MPLBACKEND": "Agg"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


def _page(site: Path, source: str) -> str:
    return (site / source.removesuffix(".md") / "index.html").read_text()


def test_site_renders_maths_at_build_time(site):
    maths = _page(site, "maths.md")
    # KaTeX's output: MathML inside class="katex" spans, display maths in class="katex-display"
    assert maths.count('class="katex"') >= 40
    assert maths.count('class="katex-display"') >= 5
    assert "<math" in maths and "<msub>" in maths
    # MathML Core (Chromium) ignores mathvariant: styled letters are Unicode characters instead
    assert "<mi>ℝ</mi>" in maths and "<mi>𝒩</mi>" in maths and "<mi>𝔼</mi>" in maths
    assert not re.search(r'mathvariant="(?:double-struck|script|bold|fraktur)"', maths)
    # the formula table is maths, not code
    table = maths[maths.index('id="parameter-and-flop-formulas"') :]
    table = table[: table.index("</table>")]
    assert table.count('class="katex"') >= 20 and "<code>" not in table


#: A TeX command left as the text of a MathML element (``<mo>\\min</mo>``): the browser shows it raw.
RAW_COMMAND = re.compile(r">\\[A-Za-z]+<")
MATH = re.compile(r"<math\b.*?</math>", re.DOTALL)
ANNOTATION = re.compile(r"<annotation\b.*?</annotation>", re.DOTALL)


def _raw_commands(html: str) -> list[str]:
    """TeX commands shown as text in ``html``'s MathML (its TeX source annotations left aside)."""
    return [hit for maths in MATH.findall(html) for hit in RAW_COMMAND.findall(ANNOTATION.sub("", maths))]


def _mathml_hook():
    spec = importlib.util.spec_from_file_location("docs_mathml_hook", ROOT / "docs" / "hooks" / "mathml.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_named_operators_render_as_words_not_commands():
    markdown = pytest.importorskip("markdown")
    pytest.importorskip("markdown_katex_rs", reason=DOCS_MISSING)
    source = (
        "CP $`\\min\\{I, O, R\\}`$, capacities $`\\log \\dim b`$, $`\\max_k \\exp x`$\n\n"
        "```math\n\\operatorname{rank} W \\le \\min_{C} \\prod_{b\\in C} \\dim b\n```\n"
    )
    html = markdown.markdown(
        source,
        extensions=["pymdownx.superfences", "markdown_katex_rs"],
        extension_configs={"markdown_katex_rs": {"insert_fonts_css": False}},
    )
    assert "<math" in html
    shown = _mathml_hook().mathml(html)
    assert _raw_commands(shown) == [], _raw_commands(shown)
    operators = re.findall(r"<mo[^>]*>([a-z]+)</mo>", shown)
    assert operators == ["min", "log", "dim", "max", "exp", "min", "dim"], operators
    # the TeX source stays in the annotation, untouched
    assert "\\log \\dim b</annotation>" in shown


def test_site_has_no_raw_tex_or_remote_assets(site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= 8
    for page in pages:
        html = page.read_text()
        text = _visible_text(html)
        assert not RAW_TEX.search(text), f"{page}: raw TeX {RAW_TEX.search(text).group()!r}"
        assert not _raw_commands(html), f"{page}: TeX commands shown as MathML text {_raw_commands(html)}"
        # unrendered $`…`$ becomes $<code>…</code>$, an unrendered ```math fence a code block
        leftover = re.search(r"\$<code>|</code>\$|language-math", html)
        assert leftover is None, f"{page}: maths left unrendered ({leftover.group()!r})"
        remote = re.search(r'<(?:script|link|img)[^>]*(?:src|href)="(?:https?:)?//[^"]*"', html)
        assert remote is None, f"{page}: loads {remote.group()} from the network"


def test_site_has_no_sphinx_roles(site):
    for page in [*sorted(site.rglob("*.html")), site / "search" / "search_index.json"]:
        html = page.read_text()
        assert not SPHINX_ROLE.search(html), f"{page}: Sphinx role {SPHINX_ROLE.search(html).group()!r}"
    api = _page(site, "api.md")
    assert api.count('class="autorefs autorefs-internal"') >= 50  # docstring cross-references resolved


def test_docstrings_use_autorefs_cross_references():
    role = re.compile(r":(?:class|func|mod|data|meth|attr|obj|exc):`")
    # the package's own docstring is not rendered on the site
    sources = [p for p in sorted((ROOT / "mumoe_tn").rglob("*.py")) if p != ROOT / "mumoe_tn" / "__init__.py"]
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if role.search(line)
    ]
    assert not offenders, f"Sphinx roles (write [`Name`][module.Name] instead): {offenders}"


def test_tutorials_show_their_output_and_end_with_a_table_or_figure(site):
    for source in TUTORIALS:
        html = _page(site, str(source.relative_to(ROOT / "docs")))
        article = html[html.index("<article") : html.index("</article>")]
        blocks = len(EXEC_BLOCK.findall(source.read_text()))
        # markdown-exec shows each block's source (a highlighted <pre>), then its output: text in a
        # second <pre>, a rendered Markdown table, or a figure
        shown = article.count('<div class="highlight">') + article.count("<table") + article.count("<svg")
        assert shown >= 2 * blocks, f"{source.name}: {blocks} executed blocks but only {shown} sources and outputs"
        tail = article[article.rindex("</pre>") :]
        ends_with_result = "<table" in tail or "<svg" in tail or "<img" in tail
        assert ends_with_result, f"{source.name} does not end with a table or figure"
        assert "Traceback" not in article, source.name


def test_no_equation_label_of_the_paper_leaks_into_the_text():
    label = re.compile(r"\b(?:Eq|Fig|Table)\. ?[a-z][a-z-]+")  # "Eq. polysemanticity": a LaTeX label, not a name
    sources = [*PAGES, *sorted((ROOT / "mumoe_tn").rglob("*.py"))]
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {label.search(line).group()}"
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if label.search(line)
    ]
    assert not offenders, offenders
