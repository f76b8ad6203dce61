"""The gate activations' Triton kernels: the interpreted checks, the mode switch, and a real compile.

The kernels run here on CPU tensors under Triton's interpreter, in a subprocess (see
``tests/gates/triton_interpreted.py`` for why and for the checks themselves), and are compiled by
Triton's real compiler for a CUDA target, which needs no GPU.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from mumoe_tn.gates import kernels

pytest.importorskip("triton")

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECKS = pathlib.Path(__file__).with_name("triton_interpreted.py")


def _without_interpreter():
    return {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}


def test_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=", str(CHECKS)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout


def test_auto_mode_keeps_cpu_and_float64_on_the_torch_paths():
    with kernels.gate_kernels("auto"):
        assert not kernels.gate_kernels_apply(torch.zeros(2, 3))
    with kernels.gate_kernels("always"):
        assert kernels.gate_kernels_apply(torch.zeros(2, 3))
        assert not kernels.gate_kernels_apply(torch.zeros(2, 3, dtype=torch.float64))


def test_modes_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="'sometimes'"):
        kernels.use_gate_kernels("sometimes")
    monkeypatch.setenv(kernels.GATE_KERNELS_ENV, "yes")
    with pytest.raises(ValueError, match=r"MUMOE_TN_GATE_KERNELS.*'yes'"):
        kernels.mode_from_environment()
    monkeypatch.setenv(kernels.GATE_KERNELS_ENV, "never")
    assert kernels.mode_from_environment() == "never"


def test_kernels_compile_for_a_cuda_target():
    # The interpreter runs Python; this compiles every kernel with Triton's real compiler (to a cubin
    # for sm_90), which needs no GPU, in a process without TRITON_INTERPRET.
    script = textwrap.dedent(
        """
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from mumoe_tn.gates import triton_kernels as K

        def pointers(kind, names):
            return {name: kind for name in names}

        rows = {"n_cols": "i32"}
        cases = []
        for dtype in ("*fp32", "*bf16", "*fp16"):
            for flag in (True, False):
                forward = {**pointers(dtype, ["x_ptr", "y_ptr"]), **rows, "x_stride": "i64", "y_stride": "i64"}
                backward = {**pointers(dtype, ["y_ptr", "g_ptr", "out_ptr"]), **rows}
                backward.update({"y_stride": "i64", "g_stride": "i64", "out_stride": "i64"})
                cases += [
                    (K._sparse_map_forward_kernel, {**forward, "max_steps": "i32"}, {"ENTMAX": flag}),
                    (K._sparse_map_backward_kernel, backward, {"ENTMAX": flag}),
                    (K._top_k_forward_kernel, {**forward, "k": "i32"}, {"RELU": flag}),
                    (K._top_k_backward_kernel, backward, {"RELU": flag}),
                ]
        for kernel, signature, constants in cases:
            constants = {**constants, "BLOCK": 256}
            signature = {**signature, **{name: "constexpr" for name in constants}}
            keys = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
            compiled = triton.compile(ASTSource(kernel, signature, constexprs=keys), target=GPUTarget("cuda", 90, 32))
            assert compiled.asm["cubin"], kernel
        print("compiled", len(cases))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=_without_interpreter(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled 24" in result.stdout


# ----------------------------------------------------------------------------- on a GPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _scatter_top_k(t, k, weigh):
    values, indices = t.topk(k, dim=-1)
    return torch.zeros_like(t).scatter(-1, indices, weigh(values))


def _cuda_references(x, name, k=3):
    """The reference map of ``x`` computed on the CPU in float64 (values and the VJP of ``weights``)."""
    import entmax

    maps = {
        "entmax15": lambda t: entmax.entmax15(t, dim=-1),
        "sparsemax": lambda t: entmax.sparsemax(t, dim=-1),
        "top_k_softmax": lambda t: _scatter_top_k(t, k, lambda values: values.softmax(-1)),
        "relu_top_k": lambda t: _scatter_top_k(torch.relu(t), k, lambda values: values),
    }
    leaf = x.detach().cpu().double().requires_grad_(True)
    weights = torch.linspace(-1, 1, x.shape[-1], dtype=torch.float64)
    y = maps[name](leaf)
    (grad,) = torch.autograd.grad((y * weights).sum(), leaf)
    return y, grad, weights


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [7, 64, 1000, 3000])
@pytest.mark.parametrize("name", ["entmax15", "sparsemax", "top_k_softmax", "relu_top_k"])
def test_cuda_kernels_equal_the_references_with_no_host_sync(name, width, dtype):
    from mumoe_tn.gates import triton_kernels

    maps = {
        "entmax15": lambda t: triton_kernels.sparse_map(t, True),
        "sparsemax": lambda t: triton_kernels.sparse_map(t, False),
        "top_k_softmax": lambda t: triton_kernels.top_k_softmax(t, 3),
        "relu_top_k": lambda t: triton_kernels.relu_top_k(t, 3),
    }
    generator = torch.Generator().manual_seed(width)
    x = (torch.randn(33, width, generator=generator) * 2).clamp(max=3)
    if name.endswith("top_k") or name.startswith("top_k"):  # three distinct largest logits: one kept set
        top = torch.rand(33, width, generator=generator).argsort(-1)[:, :3]
        x = x.scatter(-1, top, torch.tensor([5.0, 4.5, 4.0]).expand(33, 3))
    x = x.to(dtype)
    expected, expected_grad, weights = _cuda_references(x, name)
    leaf = x.cuda().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = maps[name](leaf)
        (grad,) = torch.autograd.grad((y * weights.to(device="cuda", dtype=dtype)).sum(), leaf)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(y.cpu().double(), expected, rtol=tolerance, atol=tolerance / 10)
    torch.testing.assert_close(grad.cpu().double(), expected_grad, rtol=tolerance * 10, atol=tolerance)


@cuda
def test_cuda_gates_take_the_kernels_and_replay_in_a_cuda_graph():
    from mumoe_tn.gates.modules import ExpertGate

    gate = ExpertGate(16, (24, 24), "entmax15", "layer").cuda()
    z = torch.randn(8, 16, device="cuda")
    with torch.profiler.profile() as profile:
        gate(z)
    assert any(event.name.startswith("mumoe_tn::") for event in profile.events())
    with kernels.gate_kernels("never"):
        expected = gate(z * 2)
    static = z.clone()
    with torch.no_grad():
        gate(static)  # warm-up: the kernels compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = gate(static)
        static.copy_(z * 2)
        graph.replay()
    for a, b in zip(captured, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
