"""``mumoe-tn design``."""

import json

import pytest
import torch
from torch import nn

from mumoe_tn.cli import main

SMALL = ["design", "--in", "24", "--out", "20", "--experts", "8", "--max-modes", "2", "--expert-ranks", "2", "4"]


def test_design_prints_the_front_in_every_format(capsys, tmp_path):
    assert main([*SMALL, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["target_params"] == 25 * 20  # nn.Linear(24, 20) with its bias
    assert data["points"] and all(isinstance(p["ranks"], dict) and p["params"] > 0 for p in data["points"])
    assert data["best"] in {p["structure"] for p in data["points"]}
    assert main([*SMALL, "--csv", "--all"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "structure,experts,ranks,params,fma,peak_elements,rank_bound,family,spec"
    assert len(lines) - 1 > len(data["points"])  # --all lists more than the front
    plot = tmp_path / "front.png"
    assert main([*SMALL, "--markdown", "--budget", "0.8", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "budget 400 parameters (0.8)" in out and "| structure | experts | ranks |" in out and "best: " in out
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_design_fits_a_saved_linear(capsys, tmp_path):
    path = tmp_path / "layer.pt"
    torch.manual_seed(0)
    torch.save(nn.Linear(24, 20).state_dict(), path)
    assert main([*SMALL, "--weight", str(path), "--json", "--families", "cp", "tr", "tucker"]) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    assert all(0 <= p["upcycle_error"] <= 1 for p in points)


def test_design_fits_the_terminal_and_measures_on_request(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main([*SMALL, "--measure"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 80 and "latency" in out and "best: " in out
    assert main([*SMALL, "--measure", "--json"]) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    assert all(p["latency_ms"] > 0 for p in points)  # measured, whatever the machine


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget", "-1"], "--budget: --match takes 'linear', 'mlp', a number of parameters or a fraction"),
        (["--max-fma", "-5"], "max_fma must be a positive number or None, got -5.0"),
        (["--families", "mera"], "invalid choice: 'mera'"),
        (["--weight", "missing.pt"], "--weight 'missing.pt': no such file"),
        (["--min-rank", "10000"], "no network of the search meets the budget"),
        (["--plot", "/no/such/dir/x.png"], "the directory '/no/such/dir' does not exist"),
    ],
)
def test_design_errors_are_one_line(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main([*SMALL, *args])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and message in captured.err, captured.err


def test_design_searches_mxd_and_hadamard_variants_on_request(capsys):
    assert main([*SMALL, "--budget", "852", "--families", "mxd", "chain", "--hadamard", "o", "--json", "--all"]) == 0
    data = json.loads(capsys.readouterr().out)
    structures = {p["structure"] for p in data["points"]}
    assert "mxd" in structures and data["best"] == "mxd"
    assert any(s.endswith("⊙o") for s in structures) and not any(s.endswith("⊙i") for s in structures)
    assert data["config"]["hadamard"] == ["o"]
    assert main([*SMALL, "--families", "chain", "--hadamard", "--json", "--all"]) == 0
    assert not any("⊙" in p["structure"] for p in json.loads(capsys.readouterr().out)["points"])
