"""The checks of a gate's options, shared by the descriptors and the modules they build (torch-free).

A descriptor of [`mumoe_tn.gates.specs`][mumoe_tn.gates.specs] checks its fields when it is made,
without torch and without knowing the expert dims; the module of
[`mumoe_tn.gates.modules`][mumoe_tn.gates.modules] it builds checks the same options again (a
module may be made directly) and what needs the expert dims or the registries. Both call the
functions here, so an option has one rule and one message wherever it is given.
"""

from __future__ import annotations

from collections.abc import Sequence

from mumoe_tn.gates.choices import GATE_INITS

__all__ = ["check_flag", "check_gate_options", "check_k", "check_name", "check_zero_init_bias", "per_mode_k"]


def check_flag(name: str, value: object) -> None:
    """``value`` must be a bool (TypeError naming ``name`` otherwise)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_name(name: str, value: object) -> None:
    """``value`` must be a non-empty string (TypeError naming ``name`` otherwise)."""
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a non-empty name, got {value!r}")


def check_gate_options(init: object, **flags: object) -> None:
    """The initialisation (a name of ``GATE_INITS``) and the boolean options ``flags`` of a gate."""
    if not isinstance(init, str) or init not in GATE_INITS:
        raise ValueError(f"unknown gate init {init!r}; choose one of {list(GATE_INITS)}")
    for name, value in flags.items():
        check_flag(name, value)


def check_zero_init_bias(init: object, bias: object) -> None:
    """A ReLU top-k gate initialised with zeros needs its bias (ValueError otherwise)."""
    if init == "zeros" and bias is False:
        raise ValueError(
            "init='zeros' needs bias=True for a ReLU top-k gate: with zero projections and no bias every "
            "logit is 0, the ReLU cuts them all and the gate never gets a gradient"
        )


def check_k(k: object) -> int | tuple[int, ...]:
    """``k`` as a descriptor keeps it: one positive int, or a tuple of them (one per expert mode).

    Parameters
    ----------
    k : object
        Experts kept per token: an int for every mode, or a non-empty sequence of ints.

    Returns
    -------
    int or tuple of int

    Raises
    ------
    ValueError
        If ``k`` (or an entry) is not a positive int, or the sequence is empty.
    """
    ks = tuple(k) if isinstance(k, Sequence) and not isinstance(k, str) else (k,)
    if not ks:
        raise ValueError(f"k must be a positive int or a non-empty sequence of them (one per mode), got {k!r}")
    for entry in ks:
        if isinstance(entry, bool) or not isinstance(entry, int) or entry < 1:
            raise ValueError(f"k must be a positive int or a sequence of them (one per expert mode), got {k!r}")
    return k if isinstance(k, int) else ks


def per_mode_k(k: object, expert_dims: tuple[int, ...]) -> tuple[int, ...]:
    """``k`` as one int per expert mode, each in ``[1, N_e]`` (ValueError naming ``k`` and ``N_e`` otherwise).

    Parameters
    ----------
    k : object
        One int for every mode, or one per mode.
    expert_dims : tuple of int
        ``N_1 … N_E``.

    Returns
    -------
    tuple of int
    """
    ks = tuple(k) if isinstance(k, Sequence) and not isinstance(k, str) else (k,) * len(expert_dims)
    if len(ks) != len(expert_dims):
        raise ValueError(f"k={k!r} needs one entry per expert mode {expert_dims}")
    for mode, (entry, n) in enumerate(zip(ks, expert_dims, strict=True), start=1):
        if isinstance(entry, bool) or not isinstance(entry, int) or not 1 <= entry <= n:
            if isinstance(entry, int) and not isinstance(entry, bool) and entry > n:
                problem = f"k={entry} for expert mode {mode} is more than its N_e={n}"
            else:
                problem = f"k={entry!r} for expert mode {mode} is not a positive int"
            raise ValueError(
                f"k must be an int in [1, N_e] for every expert mode {expert_dims}, got k={k!r}: {problem}"
            )
    return ks
