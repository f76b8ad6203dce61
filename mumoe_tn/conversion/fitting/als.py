"""Fit the cores of any labelled network to a dense target by alternating least squares.

This is the generic path behind
[`mumoe_tn.conversion.fitting.upcycling.upcycle_experts`][mumoe_tn.conversion.fitting.upcycling.upcycle_experts] and
[`mumoe_tn.conversion.fitting.upcycling.decompose_dense`][mumoe_tn.conversion.fitting.upcycling.decompose_dense] for
networks whose format has no closed form
(or no
format at all). Every core appears once in the network, so the network is linear in each core:
fixing all the others, the best core is the solution of a linear least-squares problem. Its
normal equations never need the design matrix: with ``P`` the core's physical legs and ``B`` its
bonds,

* the Gram matrix ``G[B, B']`` is the contraction of the *other* cores with a copy of themselves
  (bonds renamed, shared physical legs summed), and
* the right-hand side ``R[P, B]`` is the contraction of the target with the other cores,

both planned once, like any other contraction; then ``core[P, B] = R[P, :] · G⁺``, the
pseudo-inverse (eigenvalues below ``|B|·ε`` of the largest dropped), so an underdetermined core
gets its minimum-norm solution and an exact fit is exact to rounding. One sweep updates every
core in turn; sweeps stop when the relative error falls below ``tol`` or stops improving.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from tqdm.auto import tqdm

from mumoe_tn.contractions.execute import run_plan
from mumoe_tn.contractions.plan import plan_contraction

__all__ = ["als_fit"]

#: A sweep that lowers the relative error by less than this fraction of it ends the fit.
_STAGNATION = 1e-4

Labels = tuple[str, ...]


def als_fit(
    cores: Mapping[str, Labels],
    sizes: Mapping[str, int],
    target: torch.Tensor,
    target_labels: Sequence[str],
    *,
    n_iter_max: int = 200,
    tol: float = 1e-10,
    random_state: int | None = 0,
    initial: Mapping[str, torch.Tensor] | None = None,
    progress: bool | None = None,
) -> tuple[dict[str, torch.Tensor], float]:
    """Cores of the network ``cores`` that best reproduce ``target`` in the least-squares sense.

    Parameters
    ----------
    cores : Mapping[str, tuple of str]
        Core name -> labels. Every label of ``target_labels`` appears in one or more cores (a
        label in several, as in a Hadamard factorisation, splits each core's least-squares
        problem into independent ones along it); every other label is a bond (in two or more
        cores).
    sizes : Mapping[str, int]
        Size of every label.
    target : torch.Tensor
        The dense tensor to fit, with dimensions ``target_labels``; computations run in float64
        on its device.
    target_labels : Sequence[str]
        Labels of ``target``'s dimensions.
    n_iter_max : int, optional
        Maximum number of sweeps.
    tol : float, optional
        Stop once the relative error is below ``tol``, or when a sweep improves it by less than
        0.01 % of its value (stagnation).
    random_state : int, optional
        Seed of the random start (ignored with ``initial``).
    initial : Mapping[str, torch.Tensor], optional
        Starting values of the cores.
    progress : bool, optional
        Show a progress bar of the sweeps with the current error (tqdm); by default only when
        standard error is a terminal.

    Returns
    -------
    cores : dict of str to torch.Tensor
        Fitted float64 cores, shaped by their labels.
    relative_error : float
        ``‖T − T̂‖_F / ‖T‖_F``.
    """
    physical = tuple(target_labels)
    device = target.device
    data = target.detach().to(torch.float64)
    norm = float(data.norm())
    generator = torch.Generator(device=device)
    generator.manual_seed(0 if random_state is None else random_state)
    values: dict[str, torch.Tensor] = {}
    for name, labels in cores.items():
        shape = tuple(sizes[x] for x in labels)
        if initial is not None:
            values[name] = initial[name].detach().to(device=device, dtype=torch.float64).reshape(shape).clone()
        else:
            # Unit-variance entries scaled so the product over a path stays O(1).
            scale = math.prod(shape) ** (-0.5 / max(len(cores), 1))
            values[name] = torch.randn(shape, generator=generator, dtype=torch.float64, device=device) * scale
    if norm == 0.0:
        return {name: torch.zeros_like(value) for name, value in values.items()}, 0.0

    dense_plan = plan_contraction(list(cores.values()), physical, sizes)
    solvers = {name: _CoreSolver(name, cores, sizes, physical) for name in cores}
    error = math.inf
    disable = None if progress is None else not progress
    with tqdm(total=n_iter_max, desc="ALS fit", unit="sweep", leave=False, disable=disable) as bar:
        for _ in range(n_iter_max):
            for name in cores:
                values[name] = solvers[name].solve(values, data)
            fitted = run_plan(dense_plan, [values[n] for n in cores])
            new_error = float((fitted - data).norm()) / norm
            improved = error - new_error
            error = new_error
            bar.update()
            bar.set_postfix(error=f"{error:.2e}", refresh=False)
            if error < tol or improved < _STAGNATION * error:
                break
    return values, error


class _CoreSolver:
    """The normal equations of one core, planned once: ``core[S, P, B] = R[S, P, :] · G[S]⁻¹``.

    ``S`` are the core's physical labels that other cores hold too (Hadamard legs): along them
    the problem splits into independent least-squares problems, one Gram matrix each.
    """

    def __init__(self, name: str, cores: Mapping[str, Labels], sizes: Mapping[str, int], physical: Labels) -> None:
        labels = cores[name]
        self.name, self.labels, self.physical = name, labels, physical
        self.others = [other for other in cores if other != name]
        held_elsewhere = {x for other in self.others for x in cores[other]}
        self.shared = tuple(x for x in labels if x in physical and x in held_elsewhere)
        self.own_physical = tuple(x for x in labels if x in physical and x not in held_elsewhere)
        self.bonds = tuple(x for x in labels if x not in physical)
        self.sizes = sizes
        if not self.others:
            return

        def primed(x: str) -> str:
            return x if x in physical else f"{x}'"

        other_labels = [cores[other] for other in self.others]
        prime_sizes = {**sizes, **{f"{x}'": sizes[x] for x in sizes if x not in physical}}
        gram_inputs = [*other_labels, *[tuple(primed(x) for x in each) for each in other_labels]]
        gram_output = (*self.shared, *self.bonds, *(primed(x) for x in self.bonds))
        self.gram_plan = plan_contraction(gram_inputs, gram_output, prime_sizes)
        self.rhs_plan = plan_contraction(
            [physical, *other_labels], (*self.shared, *self.own_physical, *self.bonds), sizes
        )

    def solve(self, values: Mapping[str, torch.Tensor], data: torch.Tensor) -> torch.Tensor:
        """The least-squares core given the current values of the others."""
        if not self.others:
            # A single core holds the whole tensor: it is the target itself.
            return data.permute(*(self.physical.index(x) for x in self.labels)).clone()
        sizes = self.sizes
        other_values = [values[other] for other in self.others]
        gram = run_plan(self.gram_plan, other_values + other_values)
        rhs = run_plan(self.rhs_plan, [data, *other_values])
        n_shared = math.prod(sizes[x] for x in self.shared)
        n_bonds = math.prod(sizes[x] for x in self.bonds)
        n_physical = math.prod(sizes[x] for x in self.own_physical)
        gram = gram.reshape(n_shared, n_bonds, n_bonds)
        rhs = rhs.reshape(n_shared, n_physical, n_bonds)
        # G is often singular (a core's bonds can exceed what the target constrains, e.g. a 3x3x3
        # core fed by a 5-column slice): the pseudo-inverse gives the minimum-norm solution without
        # the bias a ridge would add, which limits an exact fit to ridge x cond(G) instead of rounding.
        solution = rhs @ torch.linalg.pinv(gram, hermitian=True)
        order = (*self.shared, *self.own_physical, *self.bonds)
        solution = solution.reshape(*(sizes[x] for x in order))
        return solution.permute(*(order.index(x) for x in self.labels)).contiguous()
