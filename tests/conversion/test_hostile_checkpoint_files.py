"""Crafted checkpoint files, third round: links, compressed and truncated records, and what the stock path reads.

Each case uses the harness of ``test_hostile_checkpoints.py`` (the library's ``ValueError`` matching
the rule, nothing run or imported, peak memory a small multiple of the file, bounded time, a given
model unchanged) on ``load_converted`` and, where transformers reads the files, on stock
``from_pretrained``.
"""

import os
import shutil

import pytest
import torch
from test_hostile_checkpoints import refused

from mumoe_tn.conversion.checkpoints import load_converted
from mumoe_tn.conversion.convert import convert

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
import hf_models  # noqa: E402  (needs transformers)

LOADERS = {
    "load_converted": lambda folder: load_converted(transformers.GPT2LMHeadModel, folder),
    "from_pretrained": lambda folder: transformers.GPT2LMHeadModel.from_pretrained(folder),
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A converted GPT-2 saved as one ``model.safetensors`` with a generation config; one good load each way."""
    folder = tmp_path_factory.mktemp("hf") / "converted"
    torch.manual_seed(0)
    model = hf_models.gpt2(layers=1, width=32, vocab=50, bos_token_id=0, eos_token_id=0)
    convert(model, expert_dims=4, mlps=r"mlp$", rank=4)
    model.save_pretrained(folder)
    assert sorted(os.listdir(folder)) == ["config.json", "generation_config.json", "model.safetensors"]
    for load in LOADERS.values():
        load(folder)
    return folder


def _copy(source, target):
    shutil.copytree(source, target)
    return target


# ----------------------------------------------------------------------------- links and files that are not files
@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "model.safetensors"])
def test_a_file_hard_linked_from_outside_is_refused(hf_dir, tmp_path, loader, name):
    folder = _copy(hf_dir, tmp_path / "linked")
    outside = tmp_path / "outside"
    (folder / name).rename(outside)
    os.link(outside, folder / name)  # the same inode outside the directory: what it holds is not the checkpoint's
    refused(lambda: LOADERS[loader](folder), rf"{name} '.*{name}' has 2 hard links: a checkpoint's file has one")


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize(
    ("make", "rule"),
    [
        (lambda path: path.mkdir(), r"model\.safetensors '.*' is not a regular file"),
        (
            lambda path: path.symlink_to("/dev/zero"),
            r"model\.safetensors = 'model\.safetensors' is invalid",
        ),
    ],
    ids=["directory", "device-link"],
)
def test_weights_that_are_not_a_regular_file_get_the_library_error(hf_dir, tmp_path, loader, make, rule):
    folder = _copy(hf_dir, tmp_path / "odd")
    (folder / "model.safetensors").unlink()
    make(folder / "model.safetensors")
    refused(lambda: LOADERS[loader](folder), rule)
