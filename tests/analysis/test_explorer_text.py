"""The explorer's page is valid UTF-8 whatever text the vocabulary holds, and is written whole or not at all."""

import json
import re

import explorer_models
import pytest

from mumoe_tn.analysis import Exploration, explore

LONE = "\udc80"  # half of a surrogate pair: UTF-8 cannot encode it


@pytest.fixture(scope="module")
def small():
    model, data, chars = explorer_models.char_gpt(sequences=3, context=8)
    return model, data, [f"{char}{LONE}" for char in chars]


def _payload(page):
    found = re.search(r'<script type="application/json" id="explorer-data">(.*?)</script>', page, re.S)
    return json.loads(found.group(1))


def test_a_vocabulary_with_a_lone_surrogate_gives_a_valid_page_that_keeps_the_text(small, tmp_path):
    model, data, vocabulary = small
    path = tmp_path / "experts.html"
    report = explore(
        model, data, path, vocabulary=vocabulary, title=f"title{LONE}", top_k=2, ablation=False, progress=False
    )
    page = path.read_bytes().decode("utf-8")  # strict: the page is valid UTF-8
    assert "<title>title\ufffd</title>" in page
    assert _payload(page) == json.loads(json.dumps(report.data))  # every token as the vocabulary gave it
    assert LONE in json.dumps(_payload(page), ensure_ascii=False)


def test_a_page_that_cannot_be_written_leaves_the_old_one_whole(small, tmp_path, monkeypatch):
    model, data, vocabulary = small
    report = explore(model, data, vocabulary=vocabulary, top_k=2, ablation=False, progress=False)
    path = tmp_path / "experts.html"
    path.write_text("the previous page")
    monkeypatch.setattr(Exploration, "html", property(lambda self: "<html>" + LONE))  # fails as it is encoded
    with pytest.raises(UnicodeEncodeError):
        report.save(path)
    assert path.read_text() == "the previous page"
    assert [file.name for file in tmp_path.iterdir()] == ["experts.html"]  # no partial file left beside it
