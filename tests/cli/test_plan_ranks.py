"""``mumoe-tn plan --rank``: one rank, ranks in bond order or by bond name, and networks without bonds."""

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mumoe_tn.cli import main

SPEC = "n1 a b, a i c, b c o"
SIZES = ["--in", "5", "--out", "7", "--experts", "3"]


def _plan(capsys, *args):
    assert main(["plan", *args, *SIZES]) == 0
    return capsys.readouterr().out


def _params(out):
    return int(re.search(r"params=(\d+)", out).group(1))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # every call reads capsys empty
@given(
    ranks=st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(1, 9)),
    order=st.permutations(["a", "b", "c"]),
    split=st.integers(1, 2),
)
def test_ranks_in_bond_order_and_by_name_size_the_same_bonds(capsys, ranks, order, split):
    a, b, c = ranks
    sizes = dict(zip("abc", ranks, strict=True))
    in_order = _plan(capsys, SPEC, "--rank", f"{a},{b},{c}")
    as_words = _plan(capsys, SPEC, "--rank", str(a), str(b), str(c))
    pairs = [f"{bond}={sizes[bond]}" for bond in order]
    by_name = _plan(capsys, SPEC, "--rank", ",".join(pairs))
    by_words = _plan(capsys, SPEC, "--rank", ",".join(pairs[:split]), ",".join(pairs[split:]))
    assert in_order == as_words == by_name == by_words
    assert f"bonds=(a={a}, b={b}, c={c})" in in_order
    # N·a·b + I·a·c + b·c·O with I = 5 + 1 (the folded bias), N = 3, O = 7
    assert _params(in_order) == 3 * a * b + 6 * a * c + b * c * 7


def test_one_rank_sizes_every_bond_and_the_default_is_64(capsys):
    assert "bonds=(a=4, b=4, c=4)" in _plan(capsys, SPEC, "--rank", "4")
    assert "bonds=(a=64, b=64, c=64)" in _plan(capsys, SPEC)


def test_a_named_format_takes_its_bonds_by_name(capsys):
    by_name = _plan(capsys, "tr", "--rank", "r3=6,r1=2,r2=3")
    assert by_name == _plan(capsys, "tr", "--rank", "2,3,6")
    assert "bonds=(r1=2, r2=3, r3=6)" in by_name


def test_a_network_without_bonds_needs_no_rank(capsys):
    assert main(["plan", "D: i o, C: n1 o", "--in", "33", "--out", "24", "--experts", "64"]) == 0
    out = capsys.readouterr().out
    assert "bonds=()" in out
    assert f"params={34 * 24 + 64 * 24}" in out  # D: (I + 1)·O, C: N·O
    assert f"FMA per token: {64 * 24 + 34 * 24 + 24:,}" in out  # Cᵀa, Dᵀz, their Hadamard product
    assert "expert rank <= 24" in out  # min(I + 1, O)


def _fails_with_one_line(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    assert message in captured.err, captured.err


@pytest.mark.parametrize(
    ("rank", "message"),
    [
        (["4,4"], "has 3 bonds ['a', 'b', 'c'], so it takes one rank or 3 in that order"),
        (["4", "4", "4", "4"], "got 4: (4, 4, 4, 4)"),
        (["a=4,b=4,d=32"], "names no bond ['d']"),
        (["a=4,b=4"], "leaves out ['c']"),
        (["a=4,b=x,c=3"], "ranks must be positive integers such as 64 or 4,4,64, got 'x'"),
        (["a=4,b=0,c=3"], "got '0'"),
        (["4,x"], "got '4,x'"),
        (["a=4,a=5,c=1"], "(bond 'a' twice)"),
        (["a=4,b=4", "a=5,c=3"], "--rank gives bond 'a' twice (4 and 5)"),
        (["a=4", "4"], "ranks in bond order (4,4,32) or bond=size pairs (a=4,b=4,c=32), not both, got a=4 4"),
        (["a=4,=3"], "BOND=R,BOND=R"),
    ],
)
def test_bad_ranks_get_one_line(capsys, rank, message):
    _fails_with_one_line(capsys, ["plan", SPEC, "--rank", *rank, *SIZES], message)


def test_a_rank_for_a_network_without_bonds_is_refused(capsys):
    message = "'D: i o, C: n1 o' has no bonds, so --rank 4 has nothing to size: leave it out"
    _fails_with_one_line(capsys, ["plan", "D: i o, C: n1 o", "--rank", "4"], message)
