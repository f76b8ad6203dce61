"""Crafted checkpoint files, third round: links, compressed and truncated records, and what the stock path reads.

Each case uses the harness of ``test_hostile_checkpoints.py`` (the library's ``ValueError`` matching
the rule, nothing run or imported, peak memory a small multiple of the file, bounded time, a given
model unchanged) on ``load_converted`` and, where transformers reads the files, on stock
``from_pretrained``.
"""

import copy
import encodings.cp437  # noqa: F401  (zipfile decodes the crafted files' entry names with it)
import functools
import io
import os
import shutil
import time
import zipfile

import pytest
import torch
from test_hostile_checkpoints import _converted, _plain, _write, refused

from mumoe_tn.conversion.convert import apply_conversion, conversion_record, convert
from mumoe_tn.conversion.persistence.bounds import MAX_CHECKPOINT_TENSORS
from mumoe_tn.conversion.persistence.checkpoints import load_converted, save_converted

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
    refused(lambda: LOADERS[loader](folder), rf"{name} has 2 hard links \('.*{name}'\): a checkpoint's file has one")


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


# ----------------------------------------------------------------------------- pickled records that expand
SMALL = 70_000  # a storage's element count, pickled as a 4-byte int that a crafted file rewrites


def _pickled_dir(source, target):
    """A copy of ``source`` without its weights: the crafted ``pytorch_model.bin`` goes in next."""
    folder = _copy(source, target)
    (folder / "model.safetensors").unlink()
    return folder


def _declaring(data: bytes, elements: int) -> bytes:
    """Pickled bytes with the storage of ``SMALL`` elements declared to hold ``elements``."""
    small = b"J" + SMALL.to_bytes(4, "little")
    assert data.count(small) == 1
    return data.replace(small, b"J" + elements.to_bytes(4, "little"))


def _view_of_storage():
    return {"transformer.wte.weight": torch.zeros(SMALL, dtype=torch.uint8)[:1]}  # one element of a larger storage


def test_a_compressed_pickled_record_is_refused_before_it_expands(hf_dir, tmp_path):
    folder = _pickled_dir(hf_dir, tmp_path / "deflated")
    saved = io.BytesIO()
    torch.save(_view_of_storage(), saved)
    expanded = 160 << 20  # 160 MiB of zeros, deflated to about 160 KB
    with zipfile.ZipFile(saved) as honest, zipfile.ZipFile(folder / "pytorch_model.bin", "w") as crafted:
        for entry in honest.infolist():
            data = honest.read(entry)
            if entry.filename.endswith("data.pkl"):
                crafted.writestr(entry, _declaring(data, expanded))
            elif entry.filename.endswith("data/0"):
                entry.compress_type = zipfile.ZIP_DEFLATED
                with crafted.open(entry, "w", force_zip64=True) as record:
                    for _ in range(expanded >> 20):
                        record.write(bytes(1 << 20))
            else:
                crafted.writestr(entry, data)
    size = (folder / "pytorch_model.bin").stat().st_size
    assert size < 1 << 20
    for load in LOADERS.values():
        refused(functools.partial(load, folder), r"pytorch_model\.bin.*: entry '.*data/0' is compressed", size=size)


def test_a_truncated_legacy_pickle_is_refused_before_its_storages_are_allocated(hf_dir, tmp_path):
    folder = _pickled_dir(hf_dir, tmp_path / "legacy")
    saved = io.BytesIO()
    torch.save(_view_of_storage(), saved, _use_new_zipfile_serialization=False)
    data = _declaring(saved.getvalue(), 256 << 20)  # 256 MiB declared, 70 KB stored
    (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    size = len(data) // 2
    for load in LOADERS.values():
        refused(functools.partial(load, folder), r"pytorch_model\.bin' is not in torch's zip format", size=size)


# ----------------------------------------------------------------------------- records and shapes
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A converted model's safetensors file, its record and its tensors; one good load first (imports settle)."""
    folder = tmp_path_factory.mktemp("records")
    model = _converted()
    save_converted(model, folder / "good.safetensors")
    load_converted(_plain(), folder / "good.safetensors")
    return folder, conversion_record(model).to_dict(), safetensors_torch.load_file(str(folder / "good.safetensors"))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta", "ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        (lambda: "abc", r"shapes\['0\.fc1\.weight'\] = 'abc' is invalid: give a tensor or a shape"),
        (lambda: 5, r"shapes\['0\.fc1\.weight'\] = 5 is invalid: give a tensor or a shape"),
        (lambda: (24, -1), r"shapes\['0\.fc1\.weight'\] = \(24, -1\) is invalid"),
        (lambda: torch.eye(3).to_sparse_csr(), r"shapes: tensor '0\.fc1\.weight' is sparse_csr: a checkpoint's tensor"),
        (
            lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]),
            r"shapes: tensor '0\.fc1\.weight' is nested: a checkpoint's tensor is dense",
        ),
    ],
    ids=["string", "int", "negative", "sparse", "nested"],
)
def test_shapes_that_are_not_shapes_or_dense_tensors_get_the_library_error(saved, value, pattern):
    _, record, state = saved
    model = _plain()
    shapes = {**state, "0.fc1.weight": value()}
    refused(lambda: apply_conversion(model, record, shapes=shapes), pattern, model=model)


def test_a_pickled_checkpoint_holding_a_sparse_tensor_gets_the_library_error(hf_dir, tmp_path):
    folder = _pickled_dir(hf_dir, tmp_path / "sparse")
    state = safetensors_torch.load_file(str(hf_dir / "model.safetensors"))
    torch.save(
        {**state, "transformer.wte.weight": state["transformer.wte.weight"].to_sparse()}, folder / "pytorch_model.bin"
    )
    size = (folder / "pytorch_model.bin").stat().st_size
    for load in LOADERS.values():
        refused(functools.partial(load, folder), r"tensor 'transformer\.wte\.weight' is sparse_coo", size=size)


def test_a_record_replacing_a_module_and_one_inside_it_is_refused(saved):
    folder, record, state = saved
    inner = copy.deepcopy(record["modules"][1])  # the 'linear' entry, moved inside the recorded block '0'
    inner["paths"] = ["0.fc1"]
    path = _write(folder, {**record, "modules": [*record["modules"], inner]}, state)
    model = _plain()
    pattern = r"record\.modules\[2\]\.paths = '0\.fc1' is invalid: it lies inside '0', which record\.modules\[0\]"
    refused(lambda: load_converted(model, path), pattern, model=model, size=path.stat().st_size)


def test_a_mask_argument_that_is_the_models_input_is_refused_at_load(saved):
    folder, record, state = saved
    path = _write(folder, {**record, "mask_argument": "input"}, state)
    model = _plain()
    pattern = r"record\.mask_argument = 'input' is invalid: Sequential\.forward's 'input' is not an optional argument"
    refused(lambda: load_converted(model, path), pattern, model=model, size=path.stat().st_size)
    assert load_converted(model, folder / "good.safetensors")(torch.randn(2, 12)).shape == (2, 12)


def test_a_checkpoint_of_too_many_tensors_is_refused_quickly(hf_dir, tmp_path):
    folder = _pickled_dir(hf_dir, tmp_path / "many")
    state = safetensors_torch.load_file(str(hf_dir / "model.safetensors"))
    one = torch.zeros(1)  # one 4-byte storage under every extra key
    torch.save(
        {**state, **{f"extra.{number}": one for number in range(MAX_CHECKPOINT_TENSORS)}}, folder / "pytorch_model.bin"
    )
    size = (folder / "pytorch_model.bin").stat().st_size
    for load in LOADERS.values():
        start = time.perf_counter()
        refused(
            functools.partial(load, folder),
            rf"holds {MAX_CHECKPOINT_TENSORS + len(state):,} tensors, more than",
            size=size,
        )
        assert time.perf_counter() - start < 5.0
