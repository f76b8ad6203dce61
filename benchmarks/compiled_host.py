"""Compiled cases of the host section: another case's module under ``torch.compile``, its graphs counted.

A :class:`benchmarks.baselines.Compiled` case wraps the module of the case it names (built and seeded as that case
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

import torch

from benchmarks.baselines import Case
from benchmarks.measure import HostRunner


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def compiled_case(case: Case, label: str, *, backend: str = "inductor") -> Case:
    """The case that times ``case``'s module under ``torch.compile``, with the same tokens."""
    return Case(label, "compiled", {"case": case.to_json(), "backend": backend}, case.batch, case.seq)


class CompiledHostRunner(HostRunner):
    """A compiled case (`benchmarks.baselines.Compiled`) timed: warmed up (compiled) when built, later graphs counted.

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
