"""The mumoe-tn command line."""

import json

import pytest

from mumoe_tn.cli import main


def test_compare_default_is_the_papers_gpt2_layer(capsys):
    assert main(["compare", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["in_features"] == 768 and data["config"]["out_features"] == 3072
    assert data["config"]["expert_dims"] == [256]
    names = [row["name"] for row in data["rows"]]
    assert names == ["cp μMoE", "tr μMoE", "nn.Linear", "dense MoE (N=256)", "sparse top-2 MoE (N=256)"]
    linear = data["rows"][2]["params_total"]
    for row in data["rows"][:2]:  # parameter-matched to nn.Linear within one rank step
        assert abs(row["params_total"] - linear) / linear < 0.01


def test_compare_options(capsys, tmp_path):
    plot = tmp_path / "params.png"
    args = ["compare", "--in", "64", "--out", "96", "--experts", "8", "4", "--decompositions", "cp", "tt", "tucker"]
    args += ["--rank", "cp=16", "--match", "mlp", "--no-bias", "--batch", "32", "--markdown", "--plot", str(plot)]
    assert main(args) == 0
    out = capsys.readouterr()
    assert "64 → 96 → 64 block" in out.out and "| cp μMoE block | r=16 |" in out.out
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert main(["compare", "--csv", "--match", "2e6"]) == 0
    assert capsys.readouterr().out.startswith("name,ranks,")
    assert main(["compare"]) == 0
    assert "nn.Linear" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["compare", "--match", "10"], "below the smallest possible count"),
        (["compare", "--decompositions", "nope"], "unknown decomposition 'nope'"),
        (["compare", "--rank", "tt=4"], "ranks given for ['tt']"),
        (["compare", "--match", "lots"], "--match takes 'linear', 'mlp' or a number"),
        (["compare", "--rank", "cp"], "--rank takes NAME=R"),
    ],
)
def test_compare_errors_exit_2_with_a_message(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_plan_command(capsys):
    assert main(["plan", "tr", "--experts", "32", "32", "--rank", "4", "4", "4", "128", "--batch", "64"]) == 0
    out = capsys.readouterr().out
    assert "ContractionPlan" in out and "expert rank <= 512" in out
    assert main(["plan", "A: n1 a b, B: a i c, C: b c o", "--experts", "16", "--rank", "8"]) == 0
    assert "(… n1) · (n1 a b) -> (… a b)" in capsys.readouterr().out
