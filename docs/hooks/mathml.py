r"""MkDocs hook: MathML that browsers draw as the TeX means it.

- KaTeX writes ``\mathbb{R}`` as ``<mi mathvariant="double-struck">R</mi>``. MathML Core (what
  Chromium renders) ignores every ``mathvariant`` but ``normal``, so the letter would show as a
  plain italic R. The hook replaces such letters by their Unicode mathematical alphanumeric
  characters (ℝ, 𝒩, 𝔼, …), which every browser draws.
- The KaTeX build behind ``markdown_katex_rs`` writes named operators (``\min``, ``\log``,
  ``\dim``, …) as ``<mo>\min</mo>``, so the page would show the backslash and the command. The
  hook writes the operator's name upright with a thin space after it, as TeX sets it.
"""

from __future__ import annotations

import re
from typing import Any

# First code point of each style's capital A and small a, and the letters Unicode encodes elsewhere.
_STYLES: dict[str, tuple[int, int, dict[str, str]]] = {
    "double-struck": (0x1D538, 0x1D552, dict(zip("CHNPQRZ", "ℂℍℕℙℚℝℤ", strict=True))),
    "script": (0x1D49C, 0x1D4B6, dict(zip("BEFHILMRego", "ℬℰℱℋℐℒℳℛℯℊℴ", strict=True))),
    "bold": (0x1D400, 0x1D41A, {}),
    "fraktur": (0x1D504, 0x1D51E, dict(zip("CHIRZ", "ℭℌℑℜℨ", strict=True))),
}
_LETTER = re.compile(r'<mi mathvariant="(double-struck|script|bold|fraktur)">([A-Za-z])</mi>')
_NAMED_OPERATOR = re.compile(r"<mo((?: [a-z]+=\"[^\"]*\")*)>\\([A-Za-z]+)</mo>")


def _styled(match: re.Match[str]) -> str:
    style, letter = match.groups()
    capitals, smalls, exceptions = _STYLES[style]
    if letter in exceptions:
        return f"<mi>{exceptions[letter]}</mi>"
    start, offset = (capitals, ord(letter) - ord("A")) if letter.isupper() else (smalls, ord(letter) - ord("a"))
    return f"<mi>{chr(start + offset)}</mi>"


def mathml(html: str) -> str:
    """Rewrite styled single letters and raw named operators of ``html``'s MathML."""
    html = _LETTER.sub(_styled, html)
    return _NAMED_OPERATOR.sub(r'<mo\1 lspace="0em" rspace="0.1667em">\2</mo>', html)


def on_page_content(html: str, **kwargs: Any) -> str:
    """Rewrite the MathML of every page (see the module docstring)."""
    return mathml(html)
