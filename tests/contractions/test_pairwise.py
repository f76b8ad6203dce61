"""The pairwise step as a matrix product (`mumoe_tn.contractions.pairwise`) against torch.einsum."""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch_calls import TorchCalls

from mumoe_tn.contractions import pairwise
from mumoe_tn.contractions.pairwise import (
    batched_product,
    broadcast_product,
    contract_pair,
    matrix_product,
    pair_form,
)

DTYPE = torch.float64
LABELS = "abcdefg"


@st.composite
def pairs(draw):
    """Two labelled operands and a result: any mix of shared, summed, batch and free labels."""
    pool = list(draw(st.permutations(LABELS)))[: draw(st.integers(1, 6))]
    roles = {x: draw(st.sampled_from(("first", "second", "inner", "batch", "summed"))) for x in pool}
    first = [x for x in pool if roles[x] in ("first", "inner", "batch", "summed")]
    second = [x for x in pool if roles[x] in ("second", "inner", "batch")]
    output = [x for x in pool if roles[x] in ("first", "second", "batch")]
    first, second = draw(st.permutations(first)), draw(st.permutations(second))
    if draw(st.booleans()):  # free labels of one operand first, as the planner lays steps out
        lead = draw(st.sampled_from((first, second)))
        output = sorted(output, key=lambda x: x not in lead)
    else:
        output = draw(st.permutations(output))
    sizes = {x: draw(st.integers(0 if draw(st.booleans()) and x == pool[0] else 1, 4)) for x in pool}
    return tuple(first), tuple(second), tuple(output), sizes


def _tensor(labels, sizes, gen):
    return torch.randn([sizes[x] for x in labels], generator=gen, dtype=DTYPE, requires_grad=True)


def _equation(first, second, output):
    return f"{''.join(first)},{''.join(second)}->{''.join(output)}"


@given(pairs())
def test_equals_einsum_with_gradients(case):
    first, second, output, sizes = case
    gen = torch.Generator().manual_seed(0)
    a, b = _tensor(first, sizes, gen), _tensor(second, sizes, gen)
    ours = contract_pair((first, second), output, [a, b])
    reference = torch.einsum(_equation(first, second, output), a, b)
    assert ours.shape == reference.shape
    torch.testing.assert_close(ours, reference)
    if ours.numel():
        grad = torch.randn(ours.shape, generator=gen, dtype=DTYPE)
        torch.testing.assert_close(
            torch.autograd.grad(ours, (a, b), grad), torch.autograd.grad(reference, (a, b), grad)
        )


@given(pairs())
def test_matrix_form_exactly_where_the_labels_allow_it(case):
    # By hand: a matrix form needs a summed shared label, no batch label, no label summed within
    # one operand, and the result listing one operand's free labels before the other's.
    first, second, output, _ = case
    inner = set(first) & set(second) - set(output)
    batch = set(first) & set(second) & set(output)
    own_sum = (set(first) | set(second)) - set(output) - inner
    free_first = [x for x in output if x in first]
    lead = set(output[: len(free_first)])
    split = lead == set(free_first) or set(output[: len(output) - len(free_first)]) == set(output) - set(free_first)
    expected = bool(inner) and not batch and not own_sum and split
    assert (matrix_product(first, second, output) is not None) == expected


@pytest.mark.parametrize(
    ("first", "second", "output", "swap", "left_order", "right_order"),
    [
        (("b", "i"), ("i", "r"), ("b", "r"), False, None, None),  # z @ U
        (("b", "r"), ("o", "r"), ("b", "o"), False, None, (1, 0)),  # h @ Uᵀ
        (("i", "r"), ("b", "i"), ("b", "r"), True, None, None),  # the input second
        (("r", "b"), ("r", "o"), ("o", "b"), True, (1, 0), None),  # rows from the second operand
        (("b", "c", "i"), ("i", "r"), ("c", "b", "r"), False, (1, 0, 2), None),
        (("b", "i", "j"), ("j", "r", "i"), ("b", "r"), False, None, (2, 0, 1)),  # inner i j in the order of the left
    ],
)
def test_layouts_by_hand(first, second, output, swap, left_order, right_order):
    product = matrix_product(first, second, output)
    assert (product.swap, product.left_order, product.right_order) == (swap, left_order, right_order)
    assert product.n_inner == len(set(first) & set(second) - set(output))
    assert product.n_rows == len([x for x in (second if swap else first) if x in output])


def test_matrix_steps_run_one_mm_and_no_einsum():
    gen = torch.Generator().manual_seed(1)
    z, u = torch.randn(5, 3, generator=gen, dtype=DTYPE), torch.randn(4, 3, generator=gen, dtype=DTYPE)
    with TorchCalls() as calls:
        y = contract_pair((("b", "i"), ("o", "i")), ("b", "o"), [z, u])
    assert "mm" in calls.names and "einsum" not in calls.names
    torch.testing.assert_close(y, z @ u.T)


def test_batched_steps_run_one_bmm_and_no_einsum():
    gen = torch.Generator().manual_seed(6)
    a, b = torch.randn(2, 5, 3, generator=gen, dtype=DTYPE), torch.randn(4, 3, 2, generator=gen, dtype=DTYPE)
    with TorchCalls() as calls:
        y = contract_pair((("c", "b", "i"), ("o", "i", "c")), ("o", "c", "b"), [a, b])
    assert "bmm" in calls.names and "einsum" not in calls.names
    torch.testing.assert_close(y, torch.einsum("cbi,oic->ocb", a, b))


@given(pairs())
def test_batched_form_exactly_where_the_labels_allow_it(case):
    # By hand: a batched form needs a batch label (shared and kept), a summed shared label and no
    # label summed within one operand.
    first, second, output, _ = case
    inner = set(first) & set(second) - set(output)
    batch = set(first) & set(second) & set(output)
    own_sum = (set(first) | set(second)) - set(output) - inner
    assert (batched_product(first, second, output) is not None) == (bool(batch) and bool(inner) and not own_sum)


def test_elementwise_product_is_one_multiplication():
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(5, 3, generator=gen, dtype=DTYPE), torch.randn(5, 3, generator=gen, dtype=DTYPE)
    with TorchCalls() as calls:
        y = contract_pair((("b", "r"), ("b", "r")), ("b", "r"), [a, b])
    assert "einsum" not in calls.names
    torch.testing.assert_close(y, a * b)
    # labels in another order: a permuted view, still one multiplication
    with TorchCalls() as calls:
        y = contract_pair((("b", "r"), ("r", "b")), ("b", "r"), [a, b.T.contiguous()])
    assert "einsum" not in calls.names
    torch.testing.assert_close(y, a * b)


@given(pairs())
def test_broadcast_form_exactly_where_no_label_is_summed(case):
    first, second, output, _ = case
    summed = (set(first) | set(second)) - set(output)
    assert (broadcast_product(first, second, output) is not None) == (not summed)


def test_a_batched_outer_product_is_one_multiplication_not_a_batched_product():
    # einsum runs (b, r) x (b, s) -> (b, r, s) as a bmm with an inner dimension of 1.
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(6, 4, generator=gen, dtype=DTYPE), torch.randn(6, 3, generator=gen, dtype=DTYPE)
    with TorchCalls() as calls:
        y = contract_pair((("b", "r"), ("b", "s")), ("b", "s", "r"), [a, b])
    assert "einsum" not in calls.names and "bmm" not in calls.names and "mul" in calls.names
    torch.testing.assert_close(y, torch.einsum("br,bs->bsr", a, b))
    assert y.is_contiguous()


def test_repeated_labels_take_einsum():
    gen = torch.Generator().manual_seed(4)
    square, u = torch.randn(3, 3, generator=gen, dtype=DTYPE), torch.randn(3, 2, generator=gen, dtype=DTYPE)
    for operands, output in [((("i", "i"), ("i", "r")), ("r",)), ((("b", "i"), ("i", "b")), ("b", "b"))]:
        assert matrix_product(*operands, output) is None
    torch.testing.assert_close(
        contract_pair((("i", "i"), ("i", "r")), ("r",), [square, u]), torch.einsum("ii,ir->r", square, u)
    )


def test_scalar_and_empty_results():
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(4, generator=gen, dtype=DTYPE), torch.randn(4, generator=gen, dtype=DTYPE)
    dot = contract_pair((("i",), ("i",)), (), [a, b])
    assert dot.shape == () and torch.allclose(dot, a @ b)
    empty = contract_pair((("b", "i"), ("i", "o")), ("b", "o"), [torch.ones(0, 3), torch.ones(3, 2)])
    assert empty.shape == (0, 2)
    zeros = contract_pair((("b", "i"), ("i", "o")), ("b", "o"), [torch.ones(2, 0), torch.ones(0, 5)])
    torch.testing.assert_close(zeros, torch.zeros(2, 5))


def test_eager_calls_use_the_cached_form_and_compile_traces_the_function(monkeypatch):
    # eager: the form is looked up in the cache, never recomputed; while torch.compile traces, the
    # plain function runs (dynamo warns about lru_cache wrappers and ignores them)
    a, b = torch.randn(4, 3, dtype=DTYPE), torch.randn(3, 2, dtype=DTYPE)
    asked = []
    monkeypatch.setattr(pairwise, "matrix_product", lambda *labels: asked.append(labels) or matrix_product(*labels))
    labels = ((("b", "i"), ("i", "o")), ("b", "o"))
    torch.testing.assert_close(contract_pair(*labels, [a, b]), a @ b)
    assert asked == []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    torch.testing.assert_close(contract_pair(*labels, [a, b]), a @ b)
    assert asked == [(("b", "i"), ("i", "o"), ("b", "o"))]


@pytest.mark.parametrize(
    ("operands", "output", "shapes", "message"),
    [
        # sizes swapped between two contracted labels: a reshape to (b, 6) @ (6, o) would not notice
        (
            (("b", "i", "j"), ("i", "j", "o")),
            ("b", "o"),
            [(4, 2, 3), (3, 2, 5)],
            r"^contracted labels \('i', 'j'\) have sizes \(2, 3\) in one operand and \(3, 2\) in the other$",
        ),
        (
            (("b", "i"), ("o", "i")),
            ("o", "b"),
            [(4, 3), (5, 2)],
            r"^contracted labels \('i',\) have sizes \(2,\) in one operand and \(3,\) in the other$",
        ),
        # a batch label with two sizes: a reshape into stacks of matrices would not notice
        (
            (("c", "b", "i"), ("c", "i", "o")),
            ("c", "b", "o"),
            [(2, 3, 4), (4, 3, 2)],
            r"^shared labels \('c', 'i'\) have sizes \(2, 4\) in one operand and \(4, 3\) in the other$",
        ),
        ((("b", "i"), ("i", "o")), ("b", "o"), [(4, 3, 1), (3, 5)], r"^operand 0 has shape \(4, 3, 1\) but 2 labels"),
        ((("b", "i"), ("i", "o")), ("b", "o"), [(4, 3), (3,)], r"^operand 1 has shape \(3,\) but 2 labels"),
        ((("b", "i"),), ("b",), [(4, 3), (3,)], r"^2 tensors for 1 labelled operands"),
    ],
)
def test_mismatched_tensors_are_refused_with_the_labels(operands, output, shapes, message):
    tensors = [torch.ones(shape, dtype=DTYPE) for shape in shapes]
    with pytest.raises(ValueError, match=message):
        contract_pair(operands, output, tensors)


@given(pairs())
@example((("b", "i"), ("b", "i"), ("b", "i"), {"b": 2, "i": 3}))  # mul
@example((("b",), ("i",), ("b", "i"), {"b": 2, "i": 3}))  # broadcast
@example((("b", "i"), ("i", "o"), ("b", "o"), {"b": 2, "i": 3, "o": 4}))  # mm
@example((("c", "b", "i"), ("c", "i", "o"), ("c", "b", "o"), {"c": 2, "b": 3, "i": 4, "o": 2}))  # bmm
@example((("b", "i", "j"), ("i", "o"), ("b", "o"), {"b": 2, "i": 3, "j": 2, "o": 4}))  # einsum: j summed alone
def test_a_step_s_form_is_the_first_that_serves_and_a_given_one_is_used_as_it_is(case):
    first, second, output, sizes = case
    forms = {"broadcast": broadcast_product, "mm": matrix_product, "bmm": batched_product}
    kind, form = pair_form(first, second, output)
    served = [k for k, find in forms.items() if find(first, second, output) is not None]
    if first == second == output:
        assert (kind, form) == ("mul", None)
    else:
        assert kind == (served[0] if served else "einsum")
        assert form == (forms[kind](first, second, output) if served else None)
    gen = torch.Generator().manual_seed(2)
    a, b = _tensor(first, sizes, gen), _tensor(second, sizes, gen)
    reference = torch.einsum(_equation(first, second, output), a, b)
    torch.testing.assert_close(contract_pair((first, second), output, [a, b], None, (kind, form)), reference)


def test_a_batched_product_refuses_mismatched_sizes_on_every_call():
    # the stacks are looked up per pair of shapes; a shape that fails is never kept as looked up
    product = batched_product(("c", "b", "i"), ("c", "i", "o"), ("c", "b", "o"))
    a, b = torch.ones(2, 3, 4, dtype=DTYPE), torch.ones(3, 4, 5, dtype=DTYPE)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^shared labels have sizes \(2, 4\) in one operand and \(3, 4\)"):
            pairwise.run_batched(product, a, b)
    torch.testing.assert_close(pairwise.run_batched(product, a, b[:2]), torch.einsum("cbi,cio->cbo", a, b[:2]))


@given(pairs())
@example((("b", "i"), ("i", "o"), ("b", "o"), {"b": 2, "i": 3, "o": 4}))  # a plain matrix product
@example((("c", "b", "i"), ("c", "i", "o"), ("c", "b", "o"), {"c": 2, "b": 3, "i": 4, "o": 2}))  # bmm
def test_a_form_found_once_serves_later_calls_of_other_sizes_and_strides(case):
    first, second, output, drawn = case
    form = pair_form(first, second, output)
    labels = sorted(drawn)
    for call, layout in enumerate(("contiguous", "transposed", "expanded", "contiguous")):
        # the drawn sizes first (a size may be 0), then others: size-1 axes among them
        sizes = drawn if call == 0 else {x: 1 + (k + call) % 3 for k, x in enumerate(labels)}
        gen = torch.Generator().manual_seed(call)
        operands = []
        for names in (first, second):
            tensor = torch.randn([sizes[x] for x in names], generator=gen, dtype=DTYPE)
            if layout == "transposed" and tensor.ndim >= 2:  # the same values with reversed strides
                tensor = tensor.permute(*reversed(range(tensor.ndim))).contiguous()
                tensor = tensor.permute(*reversed(range(tensor.ndim)))
            elif layout == "expanded" and tensor.ndim and tensor.shape[0]:  # a stride-0 leading axis
                tensor = tensor[:1].expand(tensor.shape)
            operands.append(tensor)
        reference = torch.einsum(_equation(first, second, output), *operands)
        got = contract_pair((first, second), output, operands, None, form)
        assert got.shape == reference.shape
        torch.testing.assert_close(got, reference, msg=lambda m, at=layout: f"{at} operands: {m}")
