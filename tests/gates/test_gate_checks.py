"""A gate option has one rule and one message, whether a descriptor or the module it builds is given it."""

from __future__ import annotations

import re

import pytest

from mumoe_tn.gates import Gate, ReLUTopKGate, TopKGate
from mumoe_tn.gates.modules import ExpertGate, ReLUTopKRouter, TopKRouter


def _message(call) -> tuple[type, str]:
    with pytest.raises((TypeError, ValueError)) as caught:
        call()
    return type(caught.value), str(caught.value)


@pytest.mark.parametrize(
    ("descriptor", "module", "expected"),
    [
        (lambda: Gate(init="x"), lambda: ExpertGate(3, 2, init="x"), r"^unknown gate init 'x'; choose one of"),
        (
            lambda: Gate(balance_loss=1),
            lambda: ExpertGate(3, 2, balance_loss=1),
            r"^balance_loss must be a bool, got 1$",
        ),
        (lambda: TopKGate(z_loss="no"), lambda: TopKRouter(3, 2, z_loss="no"), r"^z_loss must be a bool, got 'no'$"),
        (
            lambda: ReLUTopKGate(init="zeros", bias=False),
            lambda: ReLUTopKRouter(3, 4, init="zeros", bias=False),
            r"^init='zeros' needs bias=True for a ReLU top-k gate",
        ),
        (
            lambda: TopKGate(k=5).build(3, (4,)),
            lambda: ReLUTopKGate(k=5).build(3, (4,)),
            r"^k must be an int in \[1, N_e\] for every expert mode \(4,\), got k=5: k=5 for expert mode 1 is more",
        ),
        (
            lambda: TopKRouter(3, (2, 2), k=(1, 0)),
            lambda: ReLUTopKRouter(3, (2, 2), k=(1, 0)),
            r"^k must be an int in \[1, N_e\] .*got k=\(1, 0\): k=0 for expert mode 2 is not a positive int$",
        ),
    ],
)
def test_a_descriptor_and_its_module_give_one_error_for_one_option(descriptor, module, expected):
    first, second = _message(descriptor), _message(module)
    assert first == second
    assert re.search(expected, first[1]), first[1]


@pytest.mark.parametrize("descriptor", [TopKGate, ReLUTopKGate])
def test_every_top_k_descriptor_refuses_an_empty_k(descriptor):
    with pytest.raises(ValueError, match=r"k must be a positive int or a non-empty sequence of them .*got \(\)"):
        descriptor(k=())
