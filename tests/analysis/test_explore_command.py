"""``mumoe-tn explore``: a model from a function, one page written, every bad input one line."""

import re

import pytest

from mumoe_tn.cli import main

BUILDER = """
import torch
from torch import nn

from mumoe_tn.layers import MuMoEMLP


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(9, 8)
        self.block = MuMoEMLP(8, 16, 8, 4, "cp", 2, gate_norm="layer")
        self.head = nn.Linear(8, 9)

    def forward(self, tokens):
        return self.head(self.block(self.embed(tokens)))


def build():
    torch.manual_seed(0)
    return {"model": Tiny().eval(), "data": torch.randint(0, 9, (6, 10)), "vocabulary": list("abcdefghi")}


def pair():
    model = build()
    return model["model"], model["data"]


def nothing():
    return 3


def misspelt():
    return {**build(), "top_kk": 3}
"""


@pytest.fixture
def builder(tmp_path):
    path = tmp_path / "builder.py"
    path.write_text(BUILDER, encoding="utf-8")
    return path


@pytest.mark.parametrize("function", ["build", "pair"])
def test_explore_writes_the_page(builder, tmp_path, capsys, function):
    output = tmp_path / "experts.html"
    status = main(["explore", f"{builder}:{function}", "-o", str(output), "--top-k", "3", "--samples", "4", "--quiet"])
    assert status == 0
    assert capsys.readouterr().out.strip() == f"wrote {output} (1 layers, 4 experts and slices)"
    html = output.read_text(encoding="utf-8")
    assert '"samples":4' in html and '"top_k":3' in html


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("builder.py", r"MODEL must be FILE.py:FUNCTION or MODULE:FUNCTION, got 'builder.py'"),
        ("{builder}:missing", r"has no function 'missing'"),
        ("{builder}:nothing", r"must return a dict of explore\(\) arguments or a \(model, data\) pair, got int"),
        ("{builder}:misspelt", r"returned \['top_kk'\], which explore\(\) does not take"),
        ("nowhere.py:build", r"no file 'nowhere.py'"),
        ("no_such_module_here:build", r"cannot import 'no_such_module_here'"),
    ],
)
def test_explore_bad_targets_are_one_line(builder, tmp_path, capsys, target, message):
    with pytest.raises(SystemExit) as exit_:
        main(["explore", target.format(builder=builder), "-o", str(tmp_path / "x.html"), "--quiet"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert len(error.strip().splitlines()) == 1 and error.startswith("mumoe-tn explore: error: ")
    assert re.search(message, error), error


def test_explore_refuses_an_output_folder_that_does_not_exist(builder, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["explore", f"{builder}:build", "-o", str(tmp_path / "no" / "x.html")])
    assert "its folder does not exist" in capsys.readouterr().err


def test_every_analysis_pass_shows_a_progress_bar(capsys):
    import torch

    from mumoe_tn.analysis import collect_coefficients
    from mumoe_tn.layers import MuMoEMLP

    layer = MuMoEMLP(4, 8, 4, 3, "cp", 2).eval()
    collect_coefficients(layer, [torch.randn(5, 4)] * 3, progress=True)
    assert "collecting coefficients" in capsys.readouterr().err
    collect_coefficients(layer, [torch.randn(5, 4)] * 3, progress=False)
    assert "collecting coefficients" not in capsys.readouterr().err
    collect_coefficients(layer, [torch.randn(5, 4)] * 3)  # by default: a bar on a terminal only (not here)
    assert "collecting coefficients" not in capsys.readouterr().err
    with pytest.raises(TypeError, match=r"progress must be True, False or None"):
        collect_coefficients(layer, [torch.randn(5, 4)], progress="yes")
