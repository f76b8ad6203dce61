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
