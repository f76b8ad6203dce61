"""The report's sections in order, each built from its module: the one list ``benchmarks.run`` runs."""

from __future__ import annotations

from benchmarks.decoding_section import inference_section
from benchmarks.host_section import host_section
from benchmarks.sections import (
    Section,
    Sizes,
    autotune_section,
    experts_section,
    generation_section,
    handwritten_section,
    latency_section,
    layer_section,
    mxd_inference_section,
    mxd_section,
    params_section,
    scale_section,
    small_section,
)

SECTIONS = (
    "layer", "handwritten", "params", "experts", "small", "autotune", "inference", "latency", "generation", "scale",
    "mxd", "mxd-inference", "host",
)  # fmt: skip


def make_sections(
    names: list[str], sizes: Sizes, extra: dict, memory_limit: int, threads: int = 2, *, compile_rows: bool = True
) -> list[Section]:
    """The selected sections, in report order; ``threads`` is the run's thread count.

    ``compile_rows=False`` leaves the host section's ``torch.compile`` rows out (they compile
    each layer's graphs first: about a minute on two CPU cores).
    """
    builders = {
        "layer": lambda: layer_section(sizes, extra),
        "handwritten": lambda: handwritten_section(sizes, extra),
        "params": lambda: params_section(sizes, extra),
        "experts": lambda: experts_section(sizes, extra, memory_limit),
        "small": lambda: small_section(sizes, extra),
        "autotune": lambda: autotune_section(sizes, extra),
        "inference": lambda: inference_section(sizes, extra, threads),
        "latency": lambda: latency_section(sizes, extra, threads),
        "generation": lambda: generation_section(sizes, extra, threads),
        "scale": lambda: scale_section(sizes, extra),
        "mxd": lambda: mxd_section(sizes, extra),
        "mxd-inference": lambda: mxd_inference_section(sizes, extra, threads),
        "host": lambda: host_section(sizes, extra, compile_rows=compile_rows),
    }
    return [builders[name]() for name in SECTIONS if name in names]
