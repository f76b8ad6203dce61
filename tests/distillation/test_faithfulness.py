"""Evaluation of distilled replacements: CE clean / spliced / zero-ablated, the CE-loss score, L0, MSE, dead units."""

import copy
import json
import math
import warnings

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch import nn

pytest.importorskip("transformers")

from hf_models import gpt2

from mumoe_tn.cli import main
from mumoe_tn.conversion.convert import convert
from mumoe_tn.distillation.faithfulness import ZeroBlock, evaluate_replacements, next_token_loss
from mumoe_tn.distillation.frontier import FrontierTable, ce_loss_score, plot_frontier
from mumoe_tn.distillation.streaming import capture_blocks
from mumoe_tn.distillation.study import load_frontier
from mumoe_tn.distillation.training import load_replacements, spliced
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
    with pytest.warns(UserWarning, match="CE-loss score not meaningful"):  # a random model: the block barely matters
        table = evaluate_replacements(model, _batches(), {BLOCK: {"exact": exact, "zero": ZeroBlock(16)}})
    upcycled, zero = table.rows
    assert upcycled.ce_spliced == pytest.approx(upcycled.ce_clean, abs=1e-5)
    assert upcycled.kl_spliced == pytest.approx(0.0, abs=1e-6) and upcycled.kl_score == pytest.approx(1.0, abs=1e-3)
    assert upcycled.nmse < 1e-10 and upcycled.explained_variance == pytest.approx(1.0, abs=1e-8)
    assert upcycled.l0 == 2.0 and upcycled.units == 4  # top-2 of 4 experts
    assert zero.ce_spliced == zero.ce_zero and zero.kl_score == 0.0 and zero.kl_zero > 0
    assert zero.ce_zero != zero.ce_clean
    assert math.isnan(upcycled.score) and math.isnan(zero.score)  # not meaningful: no score
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
    with pytest.warns(UserWarning, match="not meaningful"):
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
    with pytest.warns(UserWarning, match="not meaningful"):
        table = evaluate_replacements(model, _batches(1), replacements, config={"tokens": 10})
    again = FrontierTable.from_json(table.to_json())
    assert again.to_json() == table.to_json() and again.config == {"tokens": 10}  # NaN L0 included
    csv_lines = table.to_csv().splitlines()
    assert csv_lines[0].startswith("block,method,params,l0,nmse") and len(csv_lines) == 3
    markdown = table.to_markdown().splitlines()
    assert "CE-loss score" in markdown[0] and len(markdown) == 6 and "scaled@2" in markdown[3]
    assert markdown[5].startswith("No CE-loss score for transformer.h.0.mlp")
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
    paired = data["paired"]  # 6 methods against 2 transcoders at 2 L0s on 2 blocks
    assert len(paired) == 6 * 2 * 2 * 2
    assert {p["baseline"].split("@")[0] for p in paired} == {"transcoder", "skip-transcoder"}
    spliced = {(r["block"], r["method"]): r["ce_spliced"] for r in rows}
    for p in paired:
        expected = spliced[p["block"], p["method"]] - spliced[p["block"], p["baseline"]]
        assert p["ce"] == pytest.approx(expected, rel=1e-6, abs=1e-9) and p["ce_low"] <= p["ce"] <= p["ce_high"]


def test_distill_command_bad_input(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["distill", "--quick", "--methods", "nope"])
    assert exit_info.value.code == 2
    assert "unknown method 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # --quick's 16 experts cannot have 32 active
        main(["distill", "--quick", "--l0", "32"])
    assert exit_info.value.code == 2
    assert "raise --experts" in capsys.readouterr().err


def test_distill_command_on_a_saved_model(tmp_path, capsys):
    torch.manual_seed(0)
    saved = gpt2(layers=1, width=16, heads=2, vocab=256, positions=32, bos_token_id=0, eos_token_id=0)
    saved.save_pretrained(tmp_path / "model")
    argv = ["distill", "--quick", "--model", str(tmp_path / "model"), "--methods", "transcoder", "cp-hier", "--l0", "4",
            "--tokens", "512", "--no-progress", "--save", str(tmp_path / "run")]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()  # stdout is not a terminal here: Markdown
    assert lines[2].startswith("| block | method | params | L0 |") and lines[3].startswith("|---|---|---:|")
    assert {line.split(" | ")[1] for line in lines[4:6]} == {"transcoder@4", "cp-hier@4"}
    with pytest.raises(ValueError, match=r"the run saved no model \(the table names '.*model'\).*model="):
        load_frontier(tmp_path / "run")  # a --model directory lies outside the run: it is not read
    given = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    model, replacements, table = load_frontier(tmp_path / "run", model=given)
    assert model is given
    row = next(row for row in table.rows if row.method == "cp-hier@4")
    reloaded = replacements[row.block][row.method]
    batches = [torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = evaluate_replacements(model, batches, {row.block: {row.method: reloaded}}).rows[0]
    assert again.params == row.params and again.l0 == 4.0  # the run's own module, spliced in
    saved = load_file(str(tmp_path / "run" / "replacements.safetensors"))
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, saved[f"{row.block}/{row.method}/{key}"]), key
    with pytest.raises(ValueError, match="holds replacements of other shapes"):
        built = {row.block: {"transcoder@4": Transcoder(16, 8, 16, k=4), "cp-hier@4": reloaded}}
        load_replacements(built, tmp_path / "run" / "replacements.safetensors")
    with pytest.raises(SystemExit):  # the directory is no longer empty
        main(argv)
    assert "--save must name a new or empty directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["distill", "--quick", "--model", str(tmp_path / "missing")])
    assert "must be a directory holding a saved Hugging Face causal LM" in capsys.readouterr().err


def _layer_calls(model):
    """Count the calls of each transformer layer (hooks), returning the counter and the hook handles."""
    calls = [0]
    handles = [layer.register_forward_hook(lambda *args: calls.__setitem__(0, calls[0] + 1))
               for layer in model.transformer.h]  # fmt: skip
    return calls, handles


@pytest.mark.parametrize("block", ["transformer.h.0.mlp", "transformer.h.2.mlp"])
@pytest.mark.parametrize("stack_tokens", [24, 10_000])  # one candidate per pass, or all in one
def test_stacked_evaluation_equals_one_whole_pass_per_replacement(block, stack_tokens):
    torch.manual_seed(3)
    model = gpt2(layers=3, width=16, heads=2, vocab=50, positions=16).eval()
    original = model.get_submodule(block)
    candidates = {f"scaled@{k}": Scaled(original, 1 - 0.3 * k) for k in range(4)}
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 9:] = False  # padding at the end of the second sequence
    batches = [{"input_ids": b, "attention_mask": mask} for b in _batches()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = evaluate_replacements(model, batches, {block: candidates}, stack_tokens=stack_tokens)
    with torch.no_grad():
        clean = [model(**b).logits.log_softmax(-1) for b in batches]
        for row in table.rows:
            total, kl, count = 0.0, 0.0, 0
            with spliced(model, {block: candidates[row.method]}):
                for b, reference in zip(batches, clean, strict=True):
                    logits = model(**b).logits
                    loss, n = next_token_loss(logits, b["input_ids"], b["attention_mask"])
                    keep = (mask[:, :-1] & mask[:, 1:]).float()
                    p, q = reference[:, :-1], logits[:, :-1].log_softmax(-1)
                    kl += float(((p.exp() * (p - q)).sum(-1) * keep).sum())
                    total, count = total + loss, count + n
            assert row.ce_spliced == pytest.approx(total / count, rel=1e-5), row.method
            assert row.kl_spliced == pytest.approx(kl / count, rel=1e-4, abs=1e-9), row.method
    assert model.get_submodule(block) is original


def test_evaluating_many_replacements_costs_well_under_a_model_pass_each():
    torch.manual_seed(3)
    model = gpt2(layers=4, width=16, heads=2, vocab=50, positions=16).eval()
    block = "transformer.h.2.mlp"
    original = model.get_submodule(block)
    replacements = 8
    candidates = {f"scaled@{k}": Scaled(original, 1 - 0.1 * k) for k in range(replacements)}
    batches = _batches(1)
    calls, handles = _layer_calls(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            evaluate_replacements(model, batches, {block: candidates})
    finally:
        for handle in handles:
            handle.remove()
    layers = len(model.transformer.h)
    one_pass_each = (1 + 1 + replacements) * layers  # clean, zero-ablated, one pass per replacement
    # the clean pass, then one stacked pass from the block's layer on (layers 2 and 3)
    assert calls[0] == layers + (layers - 2) < one_pass_each / 5
