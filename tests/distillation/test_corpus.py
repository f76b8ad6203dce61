"""A user's text and model for distillation: files in order, tokens, context lengths, and stopping on request."""

import os
import signal
from types import SimpleNamespace

import pytest
import torch

from mumoe_tn.distillation.causal_lm import CONTEXT_FIELDS, context_length
from mumoe_tn.distillation.corpus import encode_text, read_text, text_files
from mumoe_tn.distillation.interruption import DistillationStopped, StopOnSignals
from mumoe_tn.distillation.streaming import TokenWindows
from mumoe_tn.distillation.training import distill
from mumoe_tn.distillation.transcoders import Transcoder


def _tree(root):
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("bee")
    (root / "a.md").write_text("ay")
    (root / "sub" / "c.TXT").write_text("sea")
    (root / "notes.rst").write_text("not read")
    (root / "z.txt.bak").write_text("not read")
    return root


def test_a_directory_gives_its_txt_and_md_files_sorted_subdirectories_too(tmp_path):
    root = _tree(tmp_path / "texts")
    assert [p.relative_to(root).as_posix() for p in text_files(root)] == ["a.md", "b.txt", "sub/c.TXT"]
    assert read_text(root) == "ay\n\nbee\n\nsea"
    single = tmp_path / "one.log"  # a file named on its own is read whatever its name
    single.write_text("log")
    assert read_text([single, root / "b.txt"]) == "log\n\nbee"


def test_bad_text_paths_are_named(tmp_path):
    root = _tree(tmp_path / "texts")
    outside = tmp_path / "secret.txt"
    outside.write_text("outside")
    (root / "link.txt").symlink_to(outside)
    with pytest.raises(ValueError, match=r"text file '.*link.txt' links outside the directory"):
        text_files(root)
    (root / "link.txt").unlink()
    (root / "inside.txt").symlink_to(root / "b.txt")  # a link inside the directory is read
    assert read_text(root) == "ay\n\nbee\n\nbee\n\nsea"
    with pytest.raises(ValueError, match=r"the text path '.*missing' does not exist"):
        read_text(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"the directory '.*empty' holds no text file"):
        read_text(tmp_path / "empty")
    (root / "latin.txt").write_bytes(b"caf\xe9!")
    with pytest.raises(ValueError, match=r"the text file '.*latin.txt' is not UTF-8: invalid .* at byte 3"):
        read_text(root)
    (root / "latin.txt").unlink()
    with pytest.raises(ValueError, match="the text files hold 11 bytes, more than max_bytes=10"):
        read_text(root, max_bytes=10)
    (tmp_path / "blank.txt").write_text(" \n")
    with pytest.raises(ValueError, match="hold no text"):
        read_text(tmp_path / "blank.txt")
    with pytest.raises(TypeError, match="text paths must be"):
        read_text(3)


def test_tokens_are_utf8_bytes_or_the_tokenizers_ids():
    assert encode_text("aé").tolist() == [97, 195, 169]
    with pytest.raises(ValueError, match="byte tokens need a vocabulary of at least 256, the model has 100"):
        encode_text("a", vocab_size=100)

    class Letters:
        def encode(self, text):
            return [ord(c) - ord("a") for c in text]

    assert encode_text("cab", Letters(), vocab_size=3).tolist() == [2, 0, 1]
    with pytest.raises(ValueError, match="ids from 0 to 3, outside the model's vocabulary of 3"):
        encode_text("abcd", Letters(), vocab_size=3)
    with pytest.raises(TypeError, match="encode"):
        encode_text("a", object())


def test_token_windows_from_text_are_windows_of_the_files_bytes(tmp_path):
    text = "".join(chr(97 + i % 26) for i in range(300))
    (tmp_path / "t.txt").write_text(text)
    windows = TokenWindows.from_text(tmp_path / "t.txt", 16, 4, 3, seed=1)
    assert len(windows) == 3
    for batch in windows:
        assert batch.shape == (4, 16)
        for row in batch.tolist():
            assert bytes(row).decode() in text
    assert torch.equal(torch.cat(list(windows)), torch.cat(list(TokenWindows.from_text([tmp_path], 16, 4, 3, seed=1))))


def test_the_context_length_is_read_from_each_familys_field():
    transformers = pytest.importorskip("transformers")
    assert context_length(transformers.GPT2Config(n_positions=48)) == 48
    assert context_length(transformers.LlamaConfig(max_position_embeddings=96)) == 96
    assert context_length(transformers.GPTNeoXConfig(max_position_embeddings=80)) == 80
    assert context_length(transformers.GemmaConfig(max_position_embeddings=112)) == 112
    assert context_length(SimpleNamespace(n_ctx=20)) == 20
    assert context_length(SimpleNamespace(seq_length=24, max_sequence_length=9)) == 24
    assert context_length(SimpleNamespace(n_positions=None, max_sequence_length=9)) == 9
    with pytest.raises(ValueError, match=f"none of the fields {', '.join(CONTEXT_FIELDS)} is a positive int"):
        context_length(SimpleNamespace(n_positions=True, hidden_size=32))


class _TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))

    def forward(self, input_ids):
        return self.mlp(self.embed(input_ids))


def _after(calls):
    """A stop request that says yes from its ``calls``-th question on."""
    asked = [0]

    def stop():
        asked[0] += 1
        return asked[0] >= calls

    return stop


def test_a_stopped_distillation_keeps_a_checkpoint_that_resumes_to_the_same_weights(tmp_path):
    batches = [torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(i)) for i in range(20)]
    methods = {"tc": lambda block: Transcoder(block.in_features, 16, block.out_features, k=2)}
    options = {"tokens": 320, "batch_size": 16, "buffer_tokens": 64, "progress": False}
    whole = distill(_TinyLM(), batches, methods, **options).replacements["mlp"]["tc"]
    path = tmp_path / "run.pt"
    with pytest.raises(DistillationStopped, match=r"stopped after 32 of 320 tokens; its state is in .*run.pt") as info:
        distill(_TinyLM(), batches, methods, checkpoint=path, checkpoint_every=1000, stop=_after(6), **options)
    assert info.value.checkpoint == path and info.value.trained == 32
    assert torch.load(path, weights_only=True)["counters"]["trained"] == 32  # written at the stop, not by the period
    resumed = distill(_TinyLM(), batches, methods, checkpoint=path, resume=True, **options).replacements["mlp"]["tc"]
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(DistillationStopped, match="no checkpoint was kept"):
        distill(_TinyLM(), batches, methods, stop=lambda: True, **options)
    with pytest.raises(TypeError, match="stop must be a callable"):
        distill(_TinyLM(), batches, methods, stop=True, **options)


def test_signals_set_the_stop_request_only_inside_the_block():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopOnSignals() as stop:
        assert not stop()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop() and stop.signal == signal.SIGTERM and stop.exit_status == 143
        with pytest.raises(KeyboardInterrupt):  # a second signal stops at once
            os.kill(os.getpid(), signal.SIGINT)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    with StopOnSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
    assert stop.exit_status == 130
