"""Evaluation of distilled replacements: CE clean / spliced / zero-ablated, the CE-loss score, L0, MSE, dead units."""

import copy
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from hf_models import gpt2

from mumoe_tn.cli import main
from mumoe_tn.conversion.convert import convert
from mumoe_tn.distillation.faithfulness import ZeroBlock, evaluate_replacements, next_token_loss
from mumoe_tn.distillation.frontier import FrontierTable, ce_loss_score, plot_frontier
from mumoe_tn.distillation.streaming import capture_blocks
from mumoe_tn.distillation.transcoders import Transcoder
from mumoe_tn.gates.specs import TopKGate

BLOCK = "transformer.h.0.mlp"


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return gpt2(layers=2, width=16, heads=2, vocab=50, positions=16, bos_token_id=0, eos_token_id=0).eval()


def _batches(count=3, vocab=50):
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (2, 12), generator=generator) for _ in range(count)]


class Scaled(nn.Module):
    """The block's output times a constant."""

    def __init__(self, block, factor):
        super().__init__()
        self.block, self.factor = block, factor

    def forward(self, x):
        return self.factor * self.block(x)


def test_ce_loss_score_by_hand():
    assert ce_loss_score(2.0, 2.5, 4.0) == pytest.approx(0.75)
    assert ce_loss_score(2.0, 2.0, 4.0) == 1.0 and ce_loss_score(2.0, 4.0, 4.0) == 0.0
    assert math.isnan(ce_loss_score(2.0, 2.5, 2.0))


def test_next_token_loss_by_hand_and_padding():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 1] = math.log(3.0)  # p(token 1) = 3 / 6
    ids = torch.tensor([[0, 1, 2]])
    total, count = next_token_loss(logits, ids, None)
    assert count == 2 and total == pytest.approx(-math.log(0.5) - math.log(0.25))
    mask = torch.tensor([[True, True, False]])  # the last token is padding: its prediction does not count
    total, count = next_token_loss(logits, ids, mask)
    assert count == 1 and total == pytest.approx(-math.log(0.5))


@pytest.mark.parametrize("decomposition", ["cp", "mxd"])
def test_exact_upcycled_mumoe_scores_one_and_zero_ablation_zero(model, decomposition):
    converted = copy.deepcopy(model)
    convert(converted, expert_dims=4, mlps=r"h\.0\.mlp$", decomposition=decomposition, rank="exact", upcycle=True,
            gate=TopKGate(k=2))  # fmt: skip
    exact = converted.get_submodule(BLOCK)
    table = evaluate_replacements(model, _batches(), {BLOCK: {"exact": exact, "zero": ZeroBlock(16)}})
    upcycled, zero = table.rows
    assert upcycled.ce_spliced == pytest.approx(upcycled.ce_clean, abs=1e-5)
    assert upcycled.score == pytest.approx(1.0, abs=1e-3)
    assert upcycled.nmse < 1e-10 and upcycled.explained_variance == pytest.approx(1.0, abs=1e-8)
    assert upcycled.l0 == 2.0 and upcycled.units == 4  # top-2 of 4 experts
    assert zero.ce_spliced == zero.ce_zero and zero.score == 0.0
    assert zero.ce_zero != zero.ce_clean
    assert model.get_submodule(BLOCK) is not exact  # the model was put back


def test_block_metrics_against_an_independent_computation(model):
    block = model.get_submodule(BLOCK)
    torch.manual_seed(1)
    transcoder = Transcoder(16, 32, 16, k=4)
    with torch.no_grad():  # ten latents that can never fire
        transcoder.encoder.weight[:10] = 0.0
        transcoder.encoder.bias[:10] = -100.0
        transcoder.decoder.weight.normal_()
    batches = _batches()
    table = evaluate_replacements(model, batches, {BLOCK: {"half": Scaled(block, 0.5), "tc": transcoder}})
    half, tc = table.rows
    xs, ys = [], []
    with torch.no_grad(), capture_blocks(model, [BLOCK]) as captured:
        for batch in batches:
            model(input_ids=batch)
            xs.append(captured[BLOCK][0].reshape(-1, 16))
            ys.append(captured[BLOCK][1].reshape(-1, 16))
    x, y = torch.cat(xs).double().numpy(), torch.cat(ys).double().numpy()
    assert half.nmse == pytest.approx(0.25, rel=1e-9)
    variance = ((y - y.mean(0)) ** 2).sum()
    assert half.explained_variance == pytest.approx(1 - 0.25 * (y**2).sum() / variance, rel=1e-9)
    assert half.tokens == x.shape[0] == 3 * 2 * 12
    assert math.isnan(half.l0) and half.units == 0  # no sparse code to count
    assert tc.l0 == 4.0 and tc.units == 32
    with torch.no_grad():
        pre = transcoder.encoder(torch.from_numpy(x).float())
        top = pre.topk(4, dim=-1)
        fired = torch.zeros_like(pre).scatter(-1, top.indices, (top.values > 0).float()).sum(0)
    assert tc.dead == int((fired == 0).sum()) >= 10
    assert tc.params == 16 * 32 + 32 + 32 * 16 + 16


def test_table_formats_and_plot(tmp_path, model):
    block = model.get_submodule(BLOCK)
    replacements = {BLOCK: {f"scaled@{k}": Scaled(block, 1 - 0.2 * k) for k in (1, 2)}}
    table = evaluate_replacements(model, _batches(1), replacements, config={"tokens": 10})
    again = FrontierTable.from_json(table.to_json())
    assert again.to_json() == table.to_json() and again.config == {"tokens": 10}  # NaN L0 included
    csv_lines = table.to_csv().splitlines()
    assert csv_lines[0].startswith("block,method,params,l0,nmse") and len(csv_lines) == 3
    markdown = table.to_markdown().splitlines()
    assert "CE-loss score" in markdown[0] and len(markdown) == 4 and "scaled@2" in markdown[3]
    path = plot_frontier(table, tmp_path / "frontier.png", y="nmse")
    assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="y must be one of"):
        plot_frontier(table, tmp_path / "f.png", y="speed")


def test_distill_command_quick_run(tmp_path, capsys):
    plot = tmp_path / "frontier.png"
    status = main(["distill", "--quick", "--json", "--no-progress", "--plot", str(plot)])
    assert status == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["rows"]
    methods = {row["method"].split("@")[0] for row in rows}
    assert methods == {"transcoder", "skip-transcoder", "mxd", "mxd-hier", "cp", "cp-hier", "tr", "tr-hier"}
    assert len(rows) == 8 * 2 * 2  # methods × L0 × blocks
    budget = data["config"]["budget"]
    for row in rows:
        assert abs(row["params"] - budget) / budget < 0.1, row
        k = float(row["method"].split("@")[1])
        softmax_top_k = row["method"].split("@")[0] in ("cp", "cp-hier", "tr", "tr-hier")
        assert row["l0"] == k if softmax_top_k else 0 < row["l0"] <= k  # a ReLU may cut some of the top k
        assert np.isfinite(row["ce_spliced"]) and row["ce_zero"] > row["ce_clean"]
    assert plot.stat().st_size > 1000


def test_distill_command_bad_input(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["distill", "--quick", "--methods", "nope"])
    assert exit_info.value.code == 2
    assert "unknown method 'nope'" in capsys.readouterr().err


def test_distill_command_on_a_saved_model(tmp_path, capsys):
    torch.manual_seed(0)
    saved = gpt2(layers=1, width=16, heads=2, vocab=256, positions=32, bos_token_id=0, eos_token_id=0)
    saved.save_pretrained(tmp_path / "model")
    argv = ["distill", "--quick", "--model", str(tmp_path / "model"), "--methods", "transcoder", "cp-hier", "--l0", "4",
            "--tokens", "512", "--csv", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("block,method,params,l0") and len(lines) == 3  # header, two methods on one block
    assert {line.split(",")[1] for line in lines[1:]} == {"transcoder@4", "cp-hier@4"}
    with pytest.raises(SystemExit):
        main(["distill", "--quick", "--model", str(tmp_path / "missing")])
    assert "must be a directory holding a saved Hugging Face causal LM" in capsys.readouterr().err
