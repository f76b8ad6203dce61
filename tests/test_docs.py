"""The documentation's code runs: every ```python block of each page, in order, in one namespace."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([*ROOT.glob("docs/**/*.md"), ROOT / "README.md"])
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_code_runs(page, monkeypatch, tmp_path):
    blocks = BLOCK.findall(page.read_text())
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"docs_{page.stem}"}
    for number, code in enumerate(blocks):
        try:
            exec(compile(code, f"{page.name}[block {number}]", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"{page.name}, code block {number} failed: {error!r}\n{code}") from error


def test_docs_have_code():
    tutorials = [p for p in PAGES if "tutorials" in str(p)]
    assert len(tutorials) == 3 and all(BLOCK.findall(p.read_text()) for p in tutorials)
