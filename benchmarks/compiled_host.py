"""Compiled cases of the host section: another case's module under ``torch.compile``, its graphs counted.

A :class:`Compiled` case wraps the module of the case it names (built and seeded as that case
alone would be) in ``torch.compile(module, backend=..., fullgraph=True)``: on the CPU the
inductor backend generates and compiles C++ for each graph. :class:`CompiledHostRunner` times it
as the host section times every case, after a warm-up at its build (one training step with grad,
one eval call under ``no_grad``: the graphs they compile are the warm-up's), and counts the
graphs dynamo compiles during each later call (``torch._dynamo.utils.counters["stats"]
["unique_graphs"]``, read before and after the call, outside the timed span): any is a
recompile, and a timed sample that includes one is not a compiled call's time. Its kernels are
not counted: inductor's fused kernels are not ATen operators, so the host section's recorder
would undercount them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.baselines import BUILDERS, Case
from benchmarks.measure import HostRunner

#: Graphs dynamo may keep for one code object (the forward of every compiled layer of one class).
COMPILED_GRAPHS_PER_CLASS = 64


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class Compiled(nn.Module):
    """The module of ``case`` and its ``torch.compile`` (``fullgraph=True``); calls run the compiled one.

    Parameters
    ----------
    case : dict
        The wrapped case, as :meth:`benchmarks.baselines.Case.to_json` writes it.
    backend : str, optional
        ``torch.compile`` backend (default ``"inductor"``; ``"eager"`` traces without generating code).
    mode : str, optional
        ``torch.compile`` mode of the inductor backend (default: its default mode).

    Notes
    -----
    Constructing one raises dynamo's ``recompile_limit`` (process-wide) to at least
    :data:`COMPILED_GRAPHS_PER_CLASS`: the compiled layers of one class share one cache.
    """

    def __init__(self, *, case: dict, backend: str = "inductor", mode: str | None = None) -> None:
        super().__init__()
        inner = Case.from_json(case)
        if inner.model == "compiled":
            raise ValueError(f"case {inner.label!r} is compiled already")
        self.eager = BUILDERS[inner.model](**inner.options)
        # Every compiled layer of one class shares its forward's code object, whose cache holds
        # `recompile_limit` graphs in all (8 by default): room for those of many compiled layers.
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, COMPILED_GRAPHS_PER_CLASS)
        self.compiled = torch.compile(self.eager, backend=backend, mode=mode, fullgraph=True)

    def forward(self, *args: Any) -> torch.Tensor:
        return self.compiled(*args)


def compiled_case(case: Case, label: str, *, backend: str = "inductor") -> Case:
    """The case that times ``case``'s module under ``torch.compile``, with the same tokens."""
    return Case(label, "compiled", {"case": case.to_json(), "backend": backend}, case.batch, case.seq)


class CompiledHostRunner(HostRunner):
    """A :class:`Compiled` case in the host section: warmed up (compiled) when built, its later graphs counted.

    Building it runs one training step and one eval call, so that a case that fails to compile
    fails where every case's build is reported, and records the graphs they compiled and their
    time. Every later call counts the graphs compiled during it (recompiles). Its kernels are not
    counted.
    """

    def __init__(self, case: Case, device: torch.device, *, eval_tokens: int = 1) -> None:
        super().__init__(case, device, eval_tokens=eval_tokens)
        before = compiled_graphs()
        self.compile_s = self.time(self.train_step, train=True) + self.time(self.infer_step, train=False)
        self.warm_up_graphs = compiled_graphs() - before
        self.later_graphs: list[int] = []

    def time(self, step: Callable[[], None], *, train: bool) -> float:
        """Seconds of one call (see `HostRunner`); the graphs compiled during it are kept once built."""
        before = compiled_graphs()
        seconds = super().time(step, train=train)
        if hasattr(self, "later_graphs"):  # built: the warm-up is over
            self.later_graphs.append(compiled_graphs() - before)
        return seconds

    def launches(self) -> dict[str, object]:
        """Nothing: the recorder counts ATen operators, which a compiled graph's fused kernels are not."""
        return {}

    def compilation(self) -> dict[str, object]:
        """Graphs and seconds of the warm-up (train with grad, eval without), and graphs compiled after it."""
        record = {"compiled_graphs": self.warm_up_graphs, "recompiles": sum(self.later_graphs)}
        record["compile_s"] = self.compile_s
        note = f"{self.warm_up_graphs} graphs compiled at warm-up ({self.compile_s:.1f} s), "
        return record | {"note": note + f"{record['recompiles']} recompiles while timed"}
