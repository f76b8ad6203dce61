"""Constructing a layer holds little more than its parameters: no float64 copies, no full-size temporaries."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mumoe_tn import MuMoE
from mumoe_tn.layers import FactorizedExperts
from mumoe_tn.network import ExpertNetwork


class LiveBytes(TorchDispatchMode):
    """High-water mark of the storages that ops create (counted until they are freed)."""

    def __init__(self):
        super().__init__()
        self.live, self.current, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        held = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = id(storage)
                if key not in held and key not in self.live and storage.nbytes():
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key):
        self.current -= self.live.pop(key, 0)


def io_core_network(width, rank):
    """Most parameters in one i × o × rank core; two small expert cores share the rank."""
    return ExpertNetwork.from_spec(
        "E: n1 r s, IO: i o r, F: s n2", expert_dims=(16, 16), in_features=width, out_features=width, ranks=rank
    )


def peak_ratio(build):
    with LiveBytes() as counter:
        module = build()
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    return counter.peak / param_bytes


def test_the_counter_sees_a_temporary_copy():
    # The reference for the assertions below: a float64 copy of float32 parameters is 2× more.
    def build_and_copy():
        module = FactorizedExperts(io_core_network(64, 4), init="linear")
        copies = [p.double() for p in module.parameters()]
        del copies
        return module

    assert peak_ratio(build_and_copy) >= 3.0


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: FactorizedExperts(io_core_network(384, 16), init="linear"), id="custom-linear-init"),
        pytest.param(lambda: FactorizedExperts(io_core_network(384, 16), dtype=torch.float64), id="custom-float64"),
        pytest.param(lambda: FactorizedExperts(io_core_network(384, 16), dtype=torch.bfloat16), id="custom-bfloat16"),
        pytest.param(lambda: MuMoE(256, 1024, 512, "cp", rank=512), id="cp-noise-on-a-large-factor"),
        pytest.param(lambda: FactorizedExperts(io_core_network(384, 16), dtype=torch.float16), id="custom-float16"),
        pytest.param(lambda: MuMoE(256, 1024, 64, "tr", rank=(4, 4, 256)), id="tr"),
        pytest.param(lambda: MuMoE(512, 2048, (16, 16), "tt", rank=256), id="tt"),
        pytest.param(lambda: MuMoE(64, 256, (4, 4), "tucker", rank=28), id="tucker-exact-norm-of-a-large-core"),
    ],
)
def test_construction_peaks_within_one_and_a_half_times_the_parameters(build):
    assert peak_ratio(build) <= 1.5
