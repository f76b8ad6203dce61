"""``mumoe-tn design --weight FILE`` reads the file as data: declared sizes are checked before anything is allocated."""

import re
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from mumoe_tn.cli import main

WIDE = ["design", "--in", "40000", "--out", "40000", "--experts", "8", "--max-modes", "2", "--families", "cp"]
SMALL = ["design", "--in", "24", "--out", "20", "--experts", "8", "--max-modes", "2", "--families", "cp"]


def _peak_bytes():
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def _reset_peak():
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _linear_state(**change):
    torch.manual_seed(0)
    return {**nn.Linear(24, 20).state_dict(), **change}


@pytest.mark.parametrize(
    ("line", "content", "message"),
    [
        (
            WIDE,
            lambda: torch.zeros(1).expand(40000, 40000),
            r"shape \(40000, 40000\) has strides \(0, 0\), so its elements share",
        ),
        (SMALL, lambda: _linear_state(bias=torch.zeros(3)), r"its bias is \(3,\), not of shape \(20,\)"),
        (
            SMALL,
            lambda: _linear_state(extra=torch.zeros(3)),
            r"holds neither a floating tensor nor an nn\.Linear state dict",
        ),
        (
            SMALL,
            lambda: torch.eye(20, 24).to_sparse_csr(),
            r"tensor 'weight' is sparse_csr: a checkpoint's tensor is dense",
        ),
        (SMALL, lambda: torch.zeros(20, 24, dtype=torch.int64), r"its weight has dtype torch\.int64"),
    ],
    ids=["expanded", "bias-shape", "extra-key", "sparse", "integer"],
)
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_crafted_weight_file_gets_one_line_before_anything_is_allocated(capsys, tmp_path, line, content, message):
    path = tmp_path / "weight.pt"
    torch.save(content(), path)
    assert path.stat().st_size < 64 << 10
    measured = _reset_peak()
    start_peak, start = _peak_bytes(), time.perf_counter()
    with pytest.raises(SystemExit) as stopped:
        main([*line, "--weight", str(path), "--json"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err
    assert f"--weight {str(path)!r}" in err
    assert time.perf_counter() - start < 10
    if measured:
        assert _peak_bytes() - start_peak < 256 << 20, "the refusal allocated what the file declares"
