"""Analysis toolkit against independent references (dense W with zeroed experts, naive loops)."""

from contextlib import nullcontext

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from mumoe_tn import MuMoE, dense_forward
from mumoe_tn.analysis import (
    ablate,
    blind_threshold,
    class_accuracies,
    class_polysemanticity,
    collect_coefficients,
    equality_of_opportunity,
    max_min_fairness,
    mean_coefficients,
    rewrite,
    std_bias,
    steer,
    subpopulation_accuracies,
)
from mumoe_tn.analysis.ranks import expert_ranks
from mumoe_tn.layers import MuMoEMLP

DTYPE = torch.float64


def dense_output(layer, x, zero=()):
    """The layer's output from its dense W with the given experts' slices zeroed."""
    weight = layer.experts.to_dense().detach().clone()
    for index in zero:
        weight[index] = 0
    z = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=-1)
    layer(x)
    return dense_forward(weight, list(layer.last_coefficients), z)


@given(st.sampled_from(["cp", "tr", "tucker"]), st.sampled_from([(6,), (3, 2), (2, 2, 2)]), st.data())
def test_ablation_equals_zeroing_experts_in_w(name, dims, data):
    torch.manual_seed(0)
    layer = MuMoE(5, 4, dims, name, 3, dtype=DTYPE, gate_norm="layer")
    x = torch.randn(7, 5, dtype=DTYPE)
    experts = data.draw(
        st.lists(st.tuples(*(st.integers(0, n - 1) for n in dims)), min_size=1, max_size=3, unique=True)
    )
    chosen = [e[0] for e in experts] if len(dims) == 1 else experts
    with ablate(layer, chosen):
        y = layer(x)
    torch.testing.assert_close(y, dense_output(layer, x, zero=experts))
    assert layer.ablation is None  # removed after the block


def test_batched_ablation_groups_equal_single_ablations():
    torch.manual_seed(0)
    for dims in ((6,), (3, 2)):
        layer = MuMoE(5, 4, dims, "cp", 3, dtype=DTYPE).eval()
        x = torch.randn(7, 5, dtype=DTYPE)
        groups = [[(0,) * len(dims)], [tuple(n - 1 for n in dims)], []]
        with ablate(layer, groups, group_size=7):
            batched = layer(x.repeat(3, 1))
        for g, group in enumerate(groups):
            with ablate(layer, group) if group else nullcontext():
                single = layer(x)
            torch.testing.assert_close(batched[7 * g : 7 * (g + 1)], single)


def test_batched_ablation_with_different_inputs_per_group():
    # Groups need not replicate one batch: then every row is gated (no shared gate).
    torch.manual_seed(0)
    layer = MuMoE(5, 4, 6, "cp", 3, dtype=DTYPE).eval()
    x = torch.randn(2, 7, 5, dtype=DTYPE)
    with ablate(layer, [[1], [4]], group_size=7):
        batched = layer(x.reshape(14, 5))
    for g, expert in enumerate((1, 4)):
        with ablate(layer, [expert]):
            torch.testing.assert_close(batched[7 * g : 7 * (g + 1)], layer(x[g]))


def test_ablation_in_mlp_block_and_errors():
    torch.manual_seed(0)
    block = MuMoEMLP(5, 8, 5, (3, 2), "tr", 2, dtype=DTYPE).eval()
    x = torch.randn(4, 5, dtype=DTYPE)
    with ablate(block, [(1, 0)]):
        y = block(x)
    a = [c.reshape(4, -1) for c in block.last_coefficients]
    w1, w2 = block.experts1.to_dense().detach().clone(), block.experts2.to_dense().detach().clone()
    w1[1, 0] = 0
    w2[1, 0] = 0
    ones = torch.ones(4, 1, dtype=DTYPE)
    hidden = nn.functional.gelu(dense_forward(w1, a, torch.cat([x, ones], -1)))
    torch.testing.assert_close(y, dense_forward(w2, a, torch.cat([hidden, ones], -1)))
    with pytest.raises(ValueError, match=r"out of range for expert dims \(3, 2\)"):
        with ablate(block, [(3, 0)]):
            pass
    with pytest.raises(ValueError, match=r"is a 2-tuple"):
        with ablate(block, [1]):
            pass
    with pytest.raises(ValueError, match=r"first dimension must be 8"):
        with ablate(block, [[(0, 0)], [(1, 1)]], group_size=4):
            block(x)
    with pytest.raises(TypeError, match=r"layer must be a μMoE layer"):
        with ablate(nn.Linear(2, 2), [0]):
            pass


def test_collect_coefficients_streams_exact_statistics():
    torch.manual_seed(0)
    model = nn.Sequential(MuMoE(6, 8, (5, 3), "cp", 3), nn.GELU(), MuMoEMLP(8, 16, 8, 4, "tr", 2)).eval()
    batches = [torch.randn(4, 3, 6) for _ in range(3)]
    stats = collect_coefficients(model, batches, top_k=4, centres=True)
    assert set(stats) == {"0", "2"}
    captured = []
    hook = model[0].register_forward_hook(lambda m, a, o: captured.append((a[0], m.last_coefficients)))
    with torch.no_grad():  # as collect_coefficients calls the model (inference rounding)
        for batch in batches:
            model(batch)
    hook.remove()
    inputs = torch.cat([c[0].reshape(-1, 6) for c in captured]).double()
    for mode, stat in enumerate(stats["0"].modes):
        a = torch.cat([c[1][mode].reshape(-1, c[1][mode].shape[-1]) for c in captured]).double()
        assert stat.rows == 36
        torch.testing.assert_close(stat.mean, a.mean(0))
        torch.testing.assert_close(stat.load, (a >= 1e-6).sum(0))
        values = a.topk(4, dim=0).values
        torch.testing.assert_close(stat.top_values, values.T)
        torch.testing.assert_close(a.gather(0, stat.top_rows.T), values)  # rows point at those values
        torch.testing.assert_close(stat.centres(), (a.T @ inputs) / a.sum(0)[:, None])
    with pytest.raises(ValueError, match=r"no μMoE layer named \['9'\]"):
        collect_coefficients(model, batches, layers=["9"])


def test_polysemanticity_matches_naive_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.GELU(), MuMoE(12, 3, 8, "cp", 4, dtype=torch.float32))
    x, labels = torch.randn(40, 6), torch.randint(0, 3, (40,))
    result = class_polysemanticity(model, model[2], x, labels, max_rows=100)  # several chunks
    model.eval()
    with torch.no_grad():
        base = class_accuracies(model(x).argmax(-1), labels, 3)
        for k in range(8):
            with ablate(model[2], [k]):
                ablated = class_accuracies(model(x).argmax(-1), labels, 3)
            torch.testing.assert_close(result.ablated[k], ablated)
            d = torch.where(base > 0, (base - ablated) / base.clamp_min(1e-30), torch.zeros(3, dtype=DTYPE))
            one_hot = torch.zeros(3, dtype=DTYPE)
            one_hot[d.argmax()] = 1
            torch.testing.assert_close(result.differences[k], d)
            assert result.polysemanticity[k].item() == pytest.approx((d - one_hot).norm().item())
            assert bool(result.changed[k]) == bool((ablated != base).any())
    assert result.mean == pytest.approx(result.polysemanticity[result.changed].mean().item())


def test_rewrite_shifts_one_head_by_lambda_abar_a():
    torch.manual_seed(0)
    layer = MuMoE(6, 4, (5, 3), "cp", 3, dtype=DTYPE).eval()
    x = torch.randn(9, 6, dtype=DTYPE)
    mean = mean_coefficients(layer, layer, [x[:4], x[4:]])
    a1, a2 = (c.double() for c in layer.last_coefficients)
    assert mean.shape == (5, 3)
    before = layer(x)
    a1, a2 = layer.last_coefficients
    handle = rewrite(layer, 2, mean, -3.0)
    after = layer(x)
    handle.remove()
    shift = -3.0 * torch.einsum("ab,ra,rb->r", mean, a1, a2)
    torch.testing.assert_close(after[:, 2], before[:, 2] + shift)
    torch.testing.assert_close(after[:, [0, 1, 3]], before[:, [0, 1, 3]])
    torch.testing.assert_close(layer(x), before)  # removed
    handle = blind_threshold(layer, 0, 2.5)  # all-ones mean: Σ a1 a2 = 1, an unconditional shift
    torch.testing.assert_close(layer(x)[:, 0], before[:, 0] + 2.5)
    handle.remove()
    with pytest.raises(ValueError, match=r"must have shape \(5, 3\)"):
        rewrite(layer, 0, torch.ones(5), 1.0)


def test_fairness_metrics_by_hand():
    # sensitive A, target Y, prediction: subpopulations (A, Y) and their accuracies
    a = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
    y = torch.tensor([1, 1, 0, 0, 1, 1, 1, 1, 0, 0])
    p = torch.tensor([1, 0, 0, 0, 1, 1, 1, 0, 1, 0])
    assert subpopulation_accuracies(p, y, a) == {(0, 0): 1.0, (0, 1): 0.5, (1, 0): 0.5, (1, 1): 0.75}
    assert equality_of_opportunity(p, y, a) == pytest.approx(0.25)
    assert max_min_fairness(p, y, a) == 0.5
    assert std_bias(p, y, a) == pytest.approx(torch.tensor([1.0, 0.5, 0.5, 0.75]).std(unbiased=False).item())
    with pytest.raises(ValueError, match=r"binary"):
        std_bias(p + 1, y, a)


def test_steering_adds_to_the_input():
    torch.manual_seed(0)
    layer = MuMoE(6, 4, 5, "tr", 3, dtype=DTYPE).eval()
    x, direction = torch.randn(3, 6, dtype=DTYPE), torch.randn(6, dtype=DTYPE)
    expected = layer(x + 0.5 * direction)
    handle = steer(layer, direction, 0.5)
    torch.testing.assert_close(layer(x), expected)
    handle.remove()
    with pytest.raises(ValueError, match=r"shape \(6,\)"):
        steer(layer, torch.ones(5))


# ---------------------------------------------------------------- bad input: own errors, before any work
class CountingModel(nn.Module):
    """A classifier around one μMoE layer that counts its forward passes (to check nothing ran)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = MuMoE(6, 4, 5, "cp", 3, dtype=DTYPE).eval()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.layer(x)


def _ablate(layer, experts, **options):
    with ablate(layer, experts, **options):
        pass


X = torch.randn(10, 6, dtype=DTYPE)
LABELS = torch.arange(10) % 4
BAD_CALLS = {
    "ablate bool": (lambda m: _ablate(m.layer, True), TypeError, r"experts must be an int.*got True"),
    "ablate float": (lambda m: _ablate(m.layer, [1.5]), TypeError, r"an expert is an int.*got 1\.5"),
    "ablate float tensor": (lambda m: _ablate(m.layer, torch.tensor([1.0])), TypeError, r"integer dtype"),
    "ablate str": (lambda m: _ablate(m.layer, "1"), TypeError, r"experts must be.*got '1'"),
    "ablate group_size 0": (lambda m: _ablate(m.layer, [[1]], group_size=0), ValueError, r"group_size.*got 0"),
    "ablate group_size bool": (lambda m: _ablate(m.layer, [[1]], group_size=True), TypeError, r"group_size.*True"),
    "ablate no groups": (lambda m: _ablate(m.layer, [], group_size=2), ValueError, r"groups is empty"),
    "collect top_k -1": (
        lambda m: collect_coefficients(m, [X], top_k=-1),
        ValueError,
        r"top_k must be at least 0, got -1",
    ),
    "collect top_k float": (lambda m: collect_coefficients(m, [X], top_k=2.0), TypeError, r"top_k must be an int"),
    "collect threshold nan": (
        lambda m: collect_coefficients(m, [X], threshold=float("nan")),
        ValueError,
        r"threshold must be finite",
    ),
    "collect layers str": (lambda m: collect_coefficients(m, [X], layers="layer"), TypeError, r"layers must be"),
    "collect layers empty": (lambda m: collect_coefficients(m, [X], layers=[]), ValueError, r"layers is empty"),
    "collect batches tensor": (lambda m: collect_coefficients(m, X), TypeError, r"batches must be an iterable"),
    "collect forward": (lambda m: collect_coefficients(m, [X], forward=3), TypeError, r"forward must be callable"),
    "collect no model": (lambda m: collect_coefficients(3, [X]), TypeError, r"model must be a torch.nn.Module"),
    "steer list": (lambda m: steer(m.layer, [0.0] * 6), TypeError, r"direction must be a torch.Tensor, got list"),
    "steer int": (lambda m: steer(m.layer, torch.ones(6, dtype=torch.long)), TypeError, r"direction.*floating"),
    "steer nan": (lambda m: steer(m.layer, torch.full((6,), float("nan"))), ValueError, r"direction holds NaN"),
    "steer strength": (lambda m: steer(m.layer, torch.ones(6), float("inf")), ValueError, r"strength must be finite"),
    "rewrite list": (
        lambda m: rewrite(m.layer, 0, [1.0] * 5, 1.0),
        TypeError,
        r"mean must be a torch.Tensor, got list",
    ),
    "rewrite head 1.5": (
        lambda m: rewrite(m.layer, 1.5, torch.ones(5), 1.0),
        TypeError,
        r"head must be an int, got 1\.5",
    ),
    "rewrite head bool": (lambda m: rewrite(m.layer, True, torch.ones(5), 1.0), TypeError, r"head must be an int"),
    "rewrite head 4": (lambda m: rewrite(m.layer, 4, torch.ones(5), 1.0), ValueError, r"head 4 is out of range"),
    "rewrite scale": (lambda m: rewrite(m.layer, 0, torch.ones(5), "2"), TypeError, r"scale must be a real number"),
    "rewrite mean inf": (
        lambda m: rewrite(m.layer, 0, torch.full((5,), float("inf")), 1.0),
        ValueError,
        r"mean holds NaN",
    ),
    "blind head": (lambda m: blind_threshold(m.layer, -5), ValueError, r"head -5 is out of range"),
    "blind layer": (lambda m: blind_threshold(nn.Linear(2, 2), 0), TypeError, r"layer must be a μMoE layer"),
    "poly float labels": (
        lambda m: class_polysemanticity(m, m.layer, X, LABELS.float()),
        TypeError,
        r"labels must have an integer dtype, got torch.float32",
    ),
    "poly foreign layer": (
        lambda m: class_polysemanticity(m, MuMoE(6, 4, 5, "cp", 3, dtype=DTYPE), X, LABELS),
        ValueError,
        r"not inside model",
    ),
    "poly negative label": (
        lambda m: class_polysemanticity(m, m.layer, X, LABELS - 1),
        ValueError,
        r"labels must be class indices >= 0, got -1",
    ),
    "poly n_classes": (
        lambda m: class_polysemanticity(m, m.layer, X, LABELS, n_classes=2),
        ValueError,
        r"labels go up to 3 but n_classes is 2",
    ),
    "poly max_rows": (lambda m: class_polysemanticity(m, m.layer, X, LABELS, max_rows=0), ValueError, r"max_rows"),
    "poly empty": (lambda m: class_polysemanticity(m, m.layer, X[:0], LABELS[:0]), ValueError, r"inputs is empty"),
    "poly labels length": (lambda m: class_polysemanticity(m, m.layer, X, LABELS[:3]), ValueError, r"\(10,\)"),
    "poly experts": (lambda m: class_polysemanticity(m, m.layer, X, LABELS, experts=[9]), ValueError, r"\(9,\)"),
    "poly no experts": (lambda m: class_polysemanticity(m, m.layer, X, LABELS, experts=[]), ValueError, r"empty"),
    "mean foreign layer": (
        lambda m: mean_coefficients(m, MuMoE(6, 4, 5, "cp", 3, dtype=DTYPE), [X]),
        ValueError,
        r"not inside model",
    ),
    "mean no batch": (lambda m: mean_coefficients(m, m.layer, []), ValueError, r"batches is empty"),
    "accuracies float": (
        lambda m: class_accuracies(torch.zeros(3), torch.zeros(3, dtype=torch.long), 2),
        TypeError,
        r"predictions must have an integer dtype",
    ),
    "fairness 2-D": (lambda m: std_bias(torch.ones(2, 2), torch.ones(4), torch.ones(4)), ValueError, r"predictions"),
    "fairness empty": (lambda m: max_min_fairness([], [], []), ValueError, r"predictions is empty"),
    "fairness strings": (lambda m: std_bias(["a"], [1], [0]), TypeError, r"predictions must be a 1-D tensor"),
    "fairness values": (lambda m: std_bias([0, 1], [0, 2], [0, 1]), ValueError, r"targets holds \[2\]"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_analysis_rejects_bad_arguments_before_any_work(case):
    call, error, message = BAD_CALLS[case]
    model = CountingModel()
    with pytest.raises(error, match=message):
        call(model)
    assert model.calls == 0  # nothing ran
    assert not model.layer._forward_hooks and not model.layer._forward_pre_hooks  # no hook left behind
    assert model.layer.ablation is None


def test_measure_rejects_bad_arguments():
    experts = MuMoE(6, 4, (3, 2), "cp", 3).experts
    for indices, error, message in [
        (3, TypeError, r"indices must be an iterable"),
        ([1.0], TypeError, r"got 1\.0"),
        ([(0, True)], TypeError, r"got \(0, True\)"),
        ([(0,)], ValueError, r"needs 2 int"),
        ([(3, 0)], ValueError, r"out of range for expert dims \(3, 2\)"),
    ]:
        with pytest.raises(error, match=message):
            expert_ranks(experts, indices)
    with pytest.raises(TypeError, match=r"rtol must be a real number"):
        expert_ranks(experts, rtol="1e-3")
    with pytest.raises(ValueError, match=r"rtol must be a relative tolerance"):
        expert_ranks(experts, rtol=float("nan"))


def test_ablating_an_expert_twice_switches_it_off_once():
    torch.manual_seed(0)
    layer = MuMoE(5, 4, (3, 2), "cp", 3, dtype=DTYPE, gate_norm="layer")
    x = torch.randn(7, 5, dtype=DTYPE)
    with ablate(layer, [(1, 0), (1, 0)]):
        y = layer(x)
    torch.testing.assert_close(y, dense_output(layer, x, zero=[(1, 0)]))


def test_mean_coefficients_counts_every_call_of_the_layer():
    # A layer used twice per batch contributes both calls' rows; a batch that skips it is an error.
    torch.manual_seed(0)
    layer = MuMoE(4, 4, 5, "cp", 3, dtype=DTYPE, gate_norm="layer")
    model = nn.Sequential(layer, layer)
    x = torch.randn(3, 4, dtype=DTYPE)
    first = layer.gate(x)[0]
    second = layer.gate(layer(x))[0]
    expected = torch.cat([first, second]).mean(0)
    torch.testing.assert_close(mean_coefficients(model, layer, [x]), expected)
    with pytest.raises(ValueError, match=r"did not run on batch 0"):
        mean_coefficients(model, layer, [x], forward=lambda m, b: None)


def test_collect_coefficients_top_k_beyond_the_rows_seen():
    # Memory follows the rows seen, not top_k: a huge top_k keeps every row, sorted.
    torch.manual_seed(0)
    layer = MuMoE(6, 4, 5, "cp", 3, dtype=DTYPE).eval()
    x = torch.randn(3, 6, dtype=DTYPE)
    mode = collect_coefficients(layer, [x], top_k=10**30)[""].modes[0]
    layer(x)
    a = layer.last_coefficients[0]
    assert mode.top_values.shape == mode.top_rows.shape == (5, 3)
    torch.testing.assert_close(mode.top_values, a.sort(0, descending=True).values.T)
    active = mode.top_values >= 1e-6  # a row on which the expert was inactive is never listed
    assert bool((mode.top_rows[~active] == -1).all()) and bool((mode.top_rows[active] >= 0).all())
    torch.testing.assert_close(a.gather(0, mode.top_rows.clamp_min(0).T)[active.T], mode.top_values.T[active.T])
    empty = collect_coefficients(layer, [x[:0], x, x[:0]], top_k=0)[""].modes[0]  # empty batches add nothing
    assert empty.rows == 3
    assert empty.top_rows.shape == (5, 0)
    torch.testing.assert_close(empty.mean, a.mean(0))  # the other statistics are still collected
