"""The explorer's HTML page: the findings as inline JSON, rendered by an inline script; nothing from the network.

A Content-Security-Policy meta tag forbids every request (``default-src 'none'``): the script
(``page.js``) and the style sheet (``page.css``) are inlined, images are drawn from inline pixel
data. All text from the data (tokens, names) is inserted as text nodes, never as markup.
"""

from __future__ import annotations

import html
import json
import re
from importlib.resources import files

__all__ = ["render"]

CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"


#: A code point UTF-8 cannot encode: a lone surrogate (a vocabulary may hold one, e.g. half a split emoji).
_SURROGATE = re.compile("[\ud800-\udfff]")


def render(data: dict) -> str:
    """The page for the explorer's ``data`` (as built by [`explore`][mumoe_tn.analysis.explorer.explore]).

    The page is always valid UTF-8: a lone surrogate in the data is kept as a JSON escape (the
    script reads it back as it was), and shown as U+FFFD in the title.
    """
    payload = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    payload = _SURROGATE.sub(lambda found: f"\\u{ord(found.group()):04x}", payload)  # only inside JSON strings
    title = html.escape(_SURROGATE.sub("\ufffd", str(data.get("title", "Experts"))))
    style = files(__package__).joinpath("page.css").read_text(encoding="utf-8")
    script = files(__package__).joinpath("page.js").read_text(encoding="utf-8")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f'<title>{title}</title>\n<style>{style}</style>\n</head>\n<body>\n<div id="app"></div>\n'
        f'<script type="application/json" id="explorer-data">{payload}</script>\n'
        f"<script>{script}</script>\n</body>\n</html>\n"
    )
