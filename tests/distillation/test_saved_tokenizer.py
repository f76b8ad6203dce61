"""The tokenizer saved beside a model is read from that directory only: a file linked out is refused unread."""

import os

import pytest

from mumoe_tn.distillation.causal_lm import saved_tokenizer

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402  (needs transformers)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    hf_models.char_tokenizer("abc").save_pretrained(folder)
    assert (folder / "tokenizer.json").is_file()
    assert saved_tokenizer(folder)("abc")["input_ids"]  # the honest directory loads
    return folder


def _moved_out(folder, name, tmp_path):
    """``name`` moved outside the directory; returns where it went."""
    outside = tmp_path / f"outside-{name}"
    (folder / name).rename(outside)
    os.utime(outside, (1_000_000, outside.stat().st_mtime))  # an old access time: a read would update it
    return outside


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_tokenizer_file_linked_outside_is_refused_unread(saved, tmp_path, name, link):
    folder = tmp_path / "model"
    folder.mkdir()
    for file in saved.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    outside = _moved_out(folder, name, tmp_path)
    if link == "symbolic":
        (folder / name).symlink_to(outside)
        rule = rf"{name} = '{name}' is invalid: it leads outside the checkpoint directory"
    else:
        os.link(outside, folder / name)
        rule = rf"{name} has 2 hard links"
    with pytest.raises(ValueError, match=rule):
        saved_tokenizer(folder)
    assert outside.stat().st_atime == 1_000_000, "the file outside was read"
