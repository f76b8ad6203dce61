"""Hostile input: every malformed declaration, constructor argument or input gets the library's own error.

The rule checked: bad input raises a ``ValueError`` or ``TypeError``
raised *by mumoe_tn itself* (the innermost frame is in the package, not in torch, opt_einsum or
Python) whose message names the offending argument or quotes its value — never a ``KeyError``,
``IndexError``, ``AttributeError``, ``RuntimeError``, ``AssertionError`` or ``OverflowError``,
never a silent acceptance, and never more than a few seconds of work.

Each area (declarations, constructors, inputs, costs) draws from a list of case templates
``(argument, values, build)``; run ``python tests/test_bad_input.py`` for a full report of every
template × value that escapes (the hypothesis tests sample them, the report enumerates them).
"""

from __future__ import annotations

import math
import signal
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st

from mumoe_tn import ExpertNetwork
from mumoe_tn.contractions.plan import plan_forward
from mumoe_tn.costs import (
    compare,
    gate_fma,
    layer_flops,
    layer_parameters,
    linear,
    match_layer,
    min_cut,
    mlp,
    rank_bound,
    sparse_moe,
)
from mumoe_tn.decompositions import build
from mumoe_tn.layers import FactorizedExperts, MuMoE, MuMoEMLP

#: Longest any single malformed call may take (a hang guard, not a benchmark).
SECONDS = 10.0
PACKAGE = str(Path(__import__("mumoe_tn").__file__).parent)


class Hang(BaseException):
    """Raised by the alarm when a call runs past :data:`SECONDS` (BaseException: nothing catches it)."""


@contextmanager
def time_limit(seconds: float):
    """Interrupt the block after ``seconds`` (main thread, POSIX); elsewhere only measure."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def alarm(signum, frame):
        raise Hang(f"took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass(frozen=True)
class Template:
    """Malformed values of one argument and how to call the API with one of them."""

    area: str
    argument: str
    values: tuple
    build: Callable[[object], Callable[[], object]]
    mentions: tuple[str, ...] = field(default=())

    def expected(self, value: object) -> tuple[str, ...]:
        """Strings of which the error message must contain one: the argument's name or the value."""
        return (*(self.mentions or (self.argument,)), repr(value))


def outcome(call: Callable[[], object], mentions: Sequence[str]) -> str | None:
    """None if ``call`` raised the library's own error naming the argument, else what went wrong."""
    start = time.perf_counter()
    try:
        with time_limit(SECONDS):
            call()
    except Hang:
        return f"hang: still running after {SECONDS} s"
    except (ValueError, TypeError) as error:
        frames = []
        tb = error.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        origin = frames[-1] if frames else ""
        if not origin.startswith(PACKAGE):
            return f"{type(error).__name__} from {Path(origin).name}: {str(error)[:120]}"
        message = str(error)
        if not any(m in message for m in mentions):
            return f"{type(error).__name__} not naming {list(mentions)[:2]}: {message[:120]}"
        elapsed = time.perf_counter() - start
        return None if elapsed < SECONDS else f"slow: {elapsed:.1f} s"
    except Exception as error:  # the point is to classify whatever escapes
        return f"{type(error).__name__}: {str(error)[:120]}"
    return "accepted silently (no error)"


def check(template: Template, value: object) -> None:
    """Fail with a description when ``template`` called with ``value`` escapes the rule."""
    problem = outcome(template.build(value), template.expected(value))
    assert problem is None, f"{template.area} {template.argument}={value!r}: {problem}"


# ---------------------------------------------------------------- malformed values
#: Not a positive int: bools, zero and negatives, floats (also integral ones), NaN/inf, text, None.
NOT_COUNTS = (True, False, 0, -1, -(10**30), 2.0, 2.5, math.nan, math.inf, "3", None, 3j)
#: Plus absurdly large sizes that no tensor can have.
NOT_SIZES = (*NOT_COUNTS, 10**30, 2**63)
NOT_FLAGS = (2, "yes", None, 1.0)
NOT_NAMES = (3, b"cp", ("cp",), "", "two\nlines")  # None means the default name

BASE_CORES = {"A": "n1 a", "B": "a i b", "C": "b o"}
BASE_SIZES = {"n1": 3, "a": 2, "i": 4, "b": 2, "o": 5}
SPEC = "A: n1 a, B: a i b, C: b o"
SPEC_ARGS = {"expert_dims": 3, "in_features": 4, "out_features": 5, "ranks": 2}


DEFAULT = object()


def network(cores=DEFAULT, sizes=DEFAULT, **options):
    cores = BASE_CORES if cores is DEFAULT else cores
    sizes = BASE_SIZES if sizes is DEFAULT else sizes
    return lambda: ExpertNetwork(cores, sizes, **options)


def _relabel(old: str, new: str) -> dict:
    return {
        core: " ".join(new if label == old else label for label in labels.split())
        for core, labels in BASE_CORES.items()
    }


def _resized(old: str, new: str) -> dict:
    return {(new if label == old else label): size for label, size in BASE_SIZES.items()}


def _replace_label(value: object) -> Callable[[], object]:
    return network(cores={"A": ("n1", value), "B": ("a", "i", "b"), "C": ("b", "o")})


STRUCTURES = {
    "label twice in a core": ({**BASE_CORES, "A": "n1 a a"}, BASE_SIZES),
    "no input leg": ({**BASE_CORES, "B": "a b"}, {k: v for k, v in BASE_SIZES.items() if k != "i"}),
    "no output leg": ({**BASE_CORES, "C": "b"}, {k: v for k, v in BASE_SIZES.items() if k != "o"}),
    "expert legs with a gap": (_relabel("n1", "n2"), _resized("n1", "n2")),
    "leading zero n01": (_relabel("n1", "n01"), _resized("n1", "n01")),
    "non-ASCII digit n\u0661": (_relabel("n1", "n\u0661"), _resized("n1", "n\u0661")),
    "reserved __batch__": (_relabel("a", "__batch__"), _resized("a", "__batch__")),
    "physical leg twice": ({**BASE_CORES, "C": "b o i"}, BASE_SIZES),
    "dangling bond": ({**BASE_CORES, "A": "n1 a c"}, {**BASE_SIZES, "c": 2}),
    "size missing": (BASE_CORES, {k: v for k, v in BASE_SIZES.items() if k != "b"}),
    "size for unknown label": (BASE_CORES, {**BASE_SIZES, "zz": 2}),
    "disconnected": ({"A": "n1 a", "B": "a i", "C": "o c", "D": "c"}, {**BASE_SIZES, "c": 2}),
}
STRUCTURE_MENTIONS = ("'a'", "'i'", "'o'", "n2", "n01", "n\u0661", "__batch__", "'c'", "'b'", "'zz'", "disconnected")


def from_spec(**changes):
    spec = changes.pop("spec", SPEC)
    return lambda: ExpertNetwork.from_spec(spec, **{**SPEC_ARGS, **changes})


DECLARATIONS = (
    Template("declaration", "cores", ([("A", "n1 a")], "n1 a", None, {}), lambda v: network(cores=v)),
    Template("declaration", "sizes", ([("a", 2)], None, 3), lambda v: network(sizes=v)),
    Template(
        "declaration",
        "core name",
        ("1A", "a-b", "", "A B", 3, None),
        lambda v: network(cores={v: "n1 a", "B": "a i b", "C": "b o"}),
        mentions=("core name",),
    ),
    Template("declaration", "label", (3, None, "", "a b", ("a",)), _replace_label),
    Template("declaration", "size", NOT_COUNTS, lambda v: network(sizes={**BASE_SIZES, "a": v}), mentions=("'a'",)),
    Template(
        "declaration",
        "structure",
        tuple(STRUCTURES),
        lambda v: network(*STRUCTURES[v]),
        mentions=STRUCTURE_MENTIONS,
    ),
    Template("declaration", "name", NOT_NAMES, lambda v: network(name=v)),
    Template(
        "declaration",
        "spec",
        (3, None, ["n1 a"], b"n1 a", "", " ", "A: n1 a,, B: a i b, C: b o", "A: n1 a, A: a i b, C: b o"),
        lambda v: from_spec(spec=v),
        mentions=("spec", "'A'"),
    ),
    Template(
        "declaration",
        "expert_dims",
        (*NOT_COUNTS, (), (3, 0), (3, True), (2, 2)),
        lambda v: from_spec(expert_dims=v),
        mentions=("expert_dims", "n2"),
    ),
    Template("declaration", "in_features", NOT_COUNTS, lambda v: from_spec(in_features=v)),
    Template("declaration", "out_features", NOT_COUNTS, lambda v: from_spec(out_features=v)),
    Template(
        "declaration",
        "ranks",
        (*NOT_COUNTS, {"zz": 2}, {"a": 2}, {"a": 0, "b": 2}, [2, 2]),
        lambda v: from_spec(ranks=v),
        mentions=("ranks", "'a'", "'b'", "zz"),
    ),
    Template("declaration", "name", NOT_NAMES, lambda v: from_spec(name=v)),
)

# ---------------------------------------------------------------- constructors
LAYER = {"in_features": 4, "out_features": 3, "expert_dims": 4, "decomposition": "cp", "rank": 2}
BLOCK = {"in_features": 4, "hidden_features": 6, "out_features": 3, "expert_dims": 4, "decomposition": "cp", "rank": 2}
NOT_DTYPES = ("float64", "float32", torch.int64, torch.int32, torch.bool, torch.uint8, torch.complex64, 3)
NOT_DEVICES = ("gpu", "nonsense:0", 3, *(() if torch.cuda.is_available() else ("cuda",)))
COMMON = {
    "activation": ("nope", math.nan, math.inf, -math.inf, 0.5, 1.0, True),
    "gate_norm": ("nope", 3, True),
    "init": ("nope", None, 3),
    "bias": NOT_FLAGS,
    "input_norm": NOT_FLAGS,
    "expert_noise": ((math.inf,), (math.nan,), (-1.0,), "a", 3, (1.0, 2.0, 3.0)),
    "optimize": ("nope", 3),
    "dtype": NOT_DTYPES,
    "device": NOT_DEVICES,
    "decomposition": ("nope", "", 3, None),
    "expert_dims": (*NOT_SIZES, (), (2, 0), (2, -1), (2, True)),
    "rank": (*NOT_SIZES, "nope", {"zz": 2}),
}


def _make(cls, base, argument):
    return lambda v: lambda: cls(**{**base, argument: v})


def _constructor_templates() -> tuple[Template, ...]:
    templates = []
    for cls, base, extra in (
        (MuMoE, LAYER, {"rank": ("mlp",)}),
        (MuMoEMLP, BLOCK, {"rank": ("linear",), "hidden_features": NOT_SIZES, "hidden_activation": (3, torch.nn.GELU)}),
    ):
        sizes = {"in_features": NOT_SIZES, "out_features": NOT_SIZES}
        if cls is MuMoEMLP:  # out_features=None means in_features there
            sizes["out_features"] = tuple(v for v in NOT_SIZES if v is not None)
        for argument, values in {**sizes, **COMMON, **extra}.items():
            values = (*COMMON.get(argument, ()), *values) if argument in extra and argument in COMMON else values
            templates.append(Template(f"constructor {cls.__name__}", argument, values, _make(cls, base, argument)))
        templates.append(
            Template(
                f"constructor {cls.__name__}",
                "unknown option",
                ("foo", "ranks"),
                lambda v, cls=cls, base=base: lambda: cls(**base, **{v: 1}),
                mentions=("foo", "ranks"),
            )
        )
    experts = {"network": build("cp", 4, 5, 3, 2)}
    for argument, values in {
        "network": ("cp", None, 3),
        "init": COMMON["init"],
        "fan_in": tuple(v for v in NOT_SIZES if v is not None),  # None: the size of leg i
        "expert_noise": COMMON["expert_noise"],
        "optimize": COMMON["optimize"],
        "max_plans": NOT_COUNTS,
        "dtype": NOT_DTYPES,
        "device": NOT_DEVICES,
    }.items():
        templates.append(
            Template("constructor FactorizedExperts", argument, values, _make(FactorizedExperts, experts, argument))
        )
    return tuple(templates)


CONSTRUCTORS = _constructor_templates()


# ---------------------------------------------------------------- inputs
def _forward(x, *, training=False, gate_norm="layer"):
    def call():
        torch.manual_seed(0)
        layer = MuMoE(4, 3, 4, "cp", 2, gate_norm=gate_norm).train(training)
        return layer(x() if callable(x) else x)

    return call


def _experts_forward(coefficients, z=None):
    def call():
        experts = FactorizedExperts(build("cp", 4, 5, 3, 2))
        return experts(torch.randn(2, 5) if z is None else z, coefficients)

    return call


INPUTS = (
    Template("input", "input", ([[0.0] * 4], None, 3, "x"), _forward),
    Template(
        "input",
        "input shape",
        ((2, 5), (5,), (), (2, 4, 5)),
        lambda v: _forward(torch.randn(v)),
        mentions=("shape", "input"),
    ),
    Template(
        "input",
        "input dtype",
        (torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.complex64),
        lambda v: _forward(lambda: torch.ones(3, 4).to(v)),
        mentions=("dtype", "input"),
    ),
    Template(
        "input",
        "input device",
        ("meta",),
        lambda v: _forward(lambda: torch.ones(3, 4, device=v)),
        mentions=("meta", "device", "input"),
    ),
    Template(
        "input",
        "batch of one in training",
        ("batch",),
        lambda v: _forward(torch.ones(1, 4), training=True, gate_norm=v),
        mentions=("gate_norm", "eval"),
    ),
    Template(
        "input",
        "coefficients",
        ("tensor", "two", "shape", "dtype", "list"),
        lambda v: _experts_forward(
            {
                "tensor": torch.ones(2, 4),
                "two": [torch.ones(2, 4)] * 2,
                "shape": [torch.ones(3, 4)],
                "dtype": [torch.ones(2, 4, dtype=torch.float64)],
                "list": [[[1.0] * 4] * 2],
            }[v]
        ),
        mentions=("coefficient",),
    ),
)

# ---------------------------------------------------------------- costs
NET = build("cp", 4, 5, 3, 2)
SMALL = {"in_features": 16, "out_features": 16, "expert_dims": 4, "decompositions": ("cp", "tr")}
COSTS = (
    Template("costs", "network", ("cp", None, 3), lambda v: lambda: rank_bound(v)),
    Template("costs", "network", ("cp", None), lambda v: lambda: min_cut(v)),
    Template("costs", "network", ("cp", None), lambda v: lambda: match_layer(v, 100)),
    Template("costs", "network", ("cp", None), lambda v: lambda: layer_parameters(v)),
    Template("costs", "target", (*NOT_COUNTS, 1e400), lambda v: lambda: match_layer(NET, v)),
    Template("costs", "bias", NOT_FLAGS, lambda v: lambda: layer_parameters(NET, bias=v)),
    Template("costs", "bias", NOT_FLAGS, lambda v: lambda: gate_fma(NET, bias=v)),
    Template("costs", "batch", NOT_COUNTS, lambda v: lambda: layer_flops(NET, batch=v)),
    Template("costs", "batch_size", NOT_COUNTS, lambda v: lambda: plan_forward(NET, v), mentions=("batch",)),
    Template("costs", "in_features", NOT_COUNTS, lambda v: lambda: linear(v, 3)),
    Template("costs", "hidden", NOT_COUNTS, lambda v: lambda: mlp(4, v, 4)),
    Template("costs", "top_k", (*NOT_COUNTS, 5), lambda v: lambda: sparse_moe(4, v, 4, 4)),
    *(
        Template(
            "costs",
            argument,
            values,
            lambda v, a=argument: lambda: compare(**{**SMALL, a: v}),
            mentions=(argument, "nope", "decomposition") if argument == "decompositions" else (),
        )
        for argument, values in {
            # cost tables are arithmetic: huge sizes are valid there, unlike in a layer
            "in_features": NOT_COUNTS,
            "out_features": NOT_COUNTS,
            "expert_dims": NOT_COUNTS,
            "bias": NOT_FLAGS,
            "gate": NOT_FLAGS,
            "batch": NOT_COUNTS,
            "top_k": (*NOT_COUNTS, 5),
            "match": (1e400, -5, 0, "nope", True, math.nan),
            "decompositions": (["nope"], [3], "nope"),
        }.items()
    ),
)

AREAS = {"declarations": DECLARATIONS, "constructors": CONSTRUCTORS, "inputs": INPUTS, "costs": COSTS}


def cases(templates: Sequence[Template]) -> st.SearchStrategy:
    """A template and one of its malformed values."""
    return st.sampled_from(templates).flatmap(lambda t: st.tuples(st.just(t), st.sampled_from(t.values)))


@given(cases(DECLARATIONS))
def test_malformed_declarations_get_own_errors(case):
    check(*case)


@given(cases(CONSTRUCTORS))
def test_malformed_constructor_arguments_get_own_errors(case):
    check(*case)


@given(cases(INPUTS))
def test_malformed_inputs_get_own_errors(case):
    check(*case)


@given(cases(COSTS))
def test_malformed_cost_arguments_get_own_errors(case):
    check(*case)


@given(
    st.sampled_from(["entmax15", "sparsemax", "softmax"]),
    st.sampled_from(["layer", "none", "batch"]),
    st.sampled_from([math.nan, math.inf, -math.inf, 3e38]),
    st.integers(0, 5),
)
def test_non_finite_rows_give_nan_rows_only(activation, gate_norm, bad, row):
    # One row with a non-finite (or overflowing) input: that row's output is NaN, every other
    # row equals the output of the layer on the clean rows alone (eval mode, rows independent).
    torch.manual_seed(0)
    layer = MuMoE(4, 3, 5, "cp", 2, activation=activation, gate_norm=gate_norm).eval()
    x = torch.randn(6, 4)
    clean = layer(torch.cat([x[:row], x[row + 1 :]]))
    x[row, 1] = bad
    with time_limit(SECONDS):
        y = layer(x)
    if not math.isfinite(bad):  # an extreme finite input may overflow or not; it must not break other rows
        assert bool(torch.isnan(y[row]).all()), y[row]
    torch.testing.assert_close(torch.cat([y[:row], y[row + 1 :]]), clean)


def test_the_checker_itself_separates_own_errors_from_escapes():
    # The rule the tests above apply, on calls whose outcome is known.
    template = Template("self-test", "in_features", (0,), lambda v: lambda: linear(v, 3))
    assert outcome(template.build(0), template.expected(0)) is None  # the library's own ValueError

    def raised_here():
        raise ValueError("in_features must be a positive int, got 0")

    assert "from test_bad_input.py" in outcome(raised_here, ("in_features",))  # not raised by mumoe_tn
    assert "KeyError" in outcome(lambda: {}["n1"], ("n1",))
    assert outcome(lambda: torch.empty(-1), ("size",)).startswith("RuntimeError")
    assert "from" in outcome(lambda: torch.empty(2, dtype="float64"), ("dtype",))  # a TypeError raised by torch
    assert "not naming" in outcome(lambda: MuMoE(4, 3, 4, "cp", 2)(torch.ones(2, 5)), ("nothing-like-this",))
    assert outcome(lambda: None, ("x",)) == "accepted silently (no error)"


def report() -> None:
    """Print every template × value that escapes the rule (``python tests/test_bad_input.py``)."""
    for area, templates in AREAS.items():
        print(f"## {area}")
        for template in templates:
            for value in template.values:
                problem = outcome(template.build(value), template.expected(value))
                if problem is not None:
                    print(f"- {template.area}: {template.argument}={value!r} -> {problem}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    report()
