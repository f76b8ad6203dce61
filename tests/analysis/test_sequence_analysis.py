"""Sequence-model analysis: slices of hierarchical modes, dead experts, located rows, token tables, loss effects."""

import itertools
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from mumoe_tn import MuMoE
from mumoe_tn.analysis import (
    DeadExpertWarning,
    ablate,
    ablation_effects,
    collect_coefficients,
    token_coefficients,
)
from mumoe_tn.layers import MuMoEMLP

DTYPE = torch.float64


class TinyLM(nn.Module):
    """Embedding -> μMoE block -> vocabulary logits, one row per token."""

    def __init__(self, vocab=7, width=6, experts=(5,), activation="entmax15"):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, dtype=DTYPE)
        self.block = MuMoEMLP(width, 8, width, experts, "cp", 3, activation=activation, gate_norm="layer", dtype=DTYPE)
        self.head = nn.Linear(width, vocab, dtype=DTYPE)

    def forward(self, tokens):
        return self.head(self.block(self.embed(tokens)))


@settings(max_examples=12, deadline=None)
@given(
    dims=st.lists(st.integers(2, 3), min_size=2, max_size=3),
    data=st.data(),
)
def test_slice_ablation_zeroes_exactly_the_slice_of_the_dense_tensor(dims, data):
    # Reference: the dense W (N_1 × … × N_E × I × O) with the slice zeroed, contracted by hand.
    torch.manual_seed(0)
    layer = MuMoE(4, 3, tuple(dims), "cp", 3, bias=False, dtype=DTYPE).eval()
    fixed = data.draw(st.lists(st.booleans(), min_size=len(dims), max_size=len(dims)).filter(any))
    index = tuple(data.draw(st.integers(0, n - 1)) if f else None for f, n in zip(fixed, dims, strict=True))
    x = torch.randn(5, 4, dtype=DTYPE)
    with torch.no_grad():
        with ablate(layer, index):
            got = layer(x)
        z = layer.input_norm(x)
        coefficients = layer.gate(z)
        weight = layer.experts.to_dense().clone()
        weight[tuple(slice(None) if k is None else k for k in index)] = 0
        letters = "abcdef"[: len(dims)]
        spec = ",".join(f"r{c}" for c in letters) + f",ri,{letters}io->ro"
        expected = torch.einsum(spec, *coefficients, z, weight)
    torch.testing.assert_close(got, expected)


def test_slice_ablation_in_groups_and_overlaps():
    torch.manual_seed(0)
    layer = MuMoE(4, 3, (3, 2, 2), "tr", 2, dtype=DTYPE).eval()
    x = torch.randn(4, 4, dtype=DTYPE)
    with torch.no_grad():
        with ablate(layer, [[(1, None, None)], [(None, 1, 0), (2, 0, 1)]], group_size=4):
            grouped = layer(x.repeat(2, 1))
        with ablate(layer, (1, None, None)):
            first = layer(x)
        every = [t for t in itertools.product(range(3), range(2), range(2)) if t[1:] == (1, 0)] + [(2, 0, 1)]
        with ablate(layer, every):
            second = layer(x)
    torch.testing.assert_close(grouped, torch.cat([first, second]))
    with pytest.raises(ValueError, match=r"share experts"):
        with ablate(layer, [(1, 1, None), (1, None, 0)]):
            pass
    with pytest.raises(ValueError, match=r"names no index"):
        with ablate(layer, (None, None, None)):
            pass


def test_dead_experts_are_reported_and_never_listed_as_examples():
    torch.manual_seed(0)
    model = TinyLM(experts=(6,)).eval()
    keep = torch.tensor([1, 1, 1, 1, 0, 0], dtype=DTYPE)  # a gate that never picks experts 4 and 5
    model.block.gate.register_forward_hook(lambda module, args, out: tuple(a * keep for a in out))
    tokens = torch.randint(0, 7, (6, 5))
    with pytest.warns(DeadExpertWarning, match=r"2 of 6 experts of layer 'block' mode 0 were never active on 30 rows"):
        stats = collect_coefficients(model, tokens.split(4), top_k=40, progress=False)
    mode = stats["block"].modes[0]
    assert mode.dead.tolist() == [4, 5]
    assert (mode.top_rows[4:] == -1).all() and mode.examples(4) == []
    active = mode.top_values >= 1e-6
    assert ((mode.top_rows >= 0) == active).all()  # every listed row is an active one
    assert "warning: 2 of 6 experts" in stats.summary()
    assert "**Warning:** 2 of 6 experts" in stats.to_markdown()
    assert stats.rows()[0]["dead"] == 2


def test_top_rows_locate_to_sequence_and_position():
    torch.manual_seed(1)
    model = TinyLM(experts=(5,)).eval()
    tokens = torch.randint(0, 7, (7, 6))
    batches = [tokens[:3], tokens[3:4], tokens[4:]]  # uneven batches
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeadExpertWarning)
        stats = collect_coefficients(model, batches, top_k=4, progress=False)
    captured = []
    handle = model.block.register_forward_hook(lambda m, a, o: captured.append(m.last_coefficients[0]))
    with torch.no_grad():
        model(tokens)
    handle.remove()
    table = captured[0]  # (sequences, positions, experts), computed independently in one batch
    layer = stats["block"]
    for n in range(5):
        samples, positions = layer.locate(layer.modes[0].top_rows[n])
        values = layer.modes[0].top_values[n].tolist()
        for s, p, value in zip(samples.tolist(), positions.tolist(), values, strict=True):
            if s >= 0:
                assert table[s, p, n].item() == pytest.approx(value, rel=1e-9)
    with pytest.raises(ValueError, match=r"rows must lie in \[-1, 42\)"):
        layer.locate([42])


def test_token_table_lists_the_largest_coefficients_with_context():
    torch.manual_seed(2)
    model = TinyLM(experts=(2, 3)).eval()
    tokens = torch.randint(0, 7, (5, 9))
    table = token_coefficients(model, model.block, tokens, vocabulary=list("abcdefg"), batch_size=2, progress=False)
    with torch.no_grad():
        z = model.block.input_norm(model.embed(tokens))
        a = model.block.gate(z)[1]  # mode 1, computed here from the gate
    rows = table.top(2, mode=1, k=4, context=2)
    values = a[..., 2].flatten()
    order = values.argsort(descending=True)[: len(rows)]
    assert [r["coefficient"] for r in rows] == pytest.approx(values[order].tolist())
    assert len({(r["sequence"], r["position"]) for r in rows}) == len(rows)
    for row in rows:  # (tokens repeat, so equal coefficients tie: each row is checked at its own place)
        s, p = row["sequence"], row["position"]
        assert row["coefficient"] == pytest.approx(a[s, p, 2].item())
        assert row["text"] == "abcdefg"[tokens[s, p]]
        assert row["before"] == "".join("abcdefg"[t] for t in tokens[s, max(0, p - 2) : p])
    assert "| sequence | position |" in table.to_markdown(2, mode=1)
    with pytest.raises(ValueError, match=r"expert must be below 3 in mode 1, got 3"):
        table.top(3, mode=1)


def _losses(model, tokens):
    logits = model(tokens)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")


def test_loss_effects_equal_ablating_each_expert_by_hand():
    torch.manual_seed(3)
    model = TinyLM(experts=(3, 2), activation="softmax").eval()
    tokens = torch.randint(0, 7, (6, 8))
    effects = ablation_effects(model, model.block, tokens, batch_size=4, max_rows=8, progress=False)
    assert effects.experts == [(0, None), (1, None), (2, None), (None, 0), (None, 1)]
    targets = tokens[:, 1:].flatten()
    with torch.no_grad():
        intact = _losses(model, tokens)
        assert effects.loss == pytest.approx(intact.mean().item())
        for u, unit in enumerate(effects.experts):
            with ablate(model.block, unit):
                ablated = _losses(model, tokens)
                log_p = F.log_softmax(model(tokens)[:, :-1].flatten(0, 1), -1)
            assert effects.delta_loss[u].item() == pytest.approx((ablated - intact).mean().item(), abs=1e-12)
            for t in range(7):
                chosen = targets == t
                if chosen.any():
                    expected = (ablated - intact)[chosen].mean().item()
                    assert effects.target_delta[u, t].item() == pytest.approx(expected, abs=1e-12)
                else:
                    assert torch.isnan(effects.target_delta[u, t])
            intact_log_p = F.log_softmax(model(tokens)[:, :-1].flatten(0, 1), -1)
            torch.testing.assert_close(effects.logit_delta[u], (log_p - intact_log_p).mean(0))
    worst = effects.targets((0, None), k=2)
    assert worst[0][1] >= worst[1][1]
    assert effects.promoted((0, None), 1)[0][1] == effects.logit_delta[0].min().item()
    assert "| expert | Δ loss |" in effects.to_markdown()
    with pytest.raises(ValueError, match=r"was not ablated"):
        effects.targets((0, 1))


def test_plots_draw_one_bar_per_expert():
    import matplotlib

    matplotlib.use("Agg")
    torch.manual_seed(4)
    model = TinyLM(experts=(3, 2), activation="softmax").eval()
    tokens = torch.randint(0, 7, (4, 6))
    effects = ablation_effects(model, model.block, tokens, progress=False)
    assert len(effects.plot().axes[0].patches) == len(effects.experts) == 5
    stats = collect_coefficients(model, [tokens], progress=False)
    figure = stats.plot()
    assert [len(ax.patches) for ax in figure.axes] == [3, 2]  # one panel per mode, one bar per expert
    table = token_coefficients(model, model.block, tokens, progress=False)
    assert sum(p.get_height() for p in table.plot(1, mode=1).axes[0].patches) == int(
        (table.coefficients[1][..., 1] >= 1e-6).sum()
    )
