"""Named decomposition formats (CP, TR, TT, Tucker, MxD) and their registry.

Each format is a [`Format`][mumoe_tn.decompositions.format.Format] subclass registered by name (``class CPFormat(Format,
name="cp")``) and carried by the networks it builds; [`build`][mumoe_tn.decompositions.registry.build] looks one up by
name. A new named decomposition is one small module defining such a class — see
[`Format`][mumoe_tn.decompositions.format.Format].
"""

from mumoe_tn.decompositions.cp import CPFormat, cp
from mumoe_tn.decompositions.format import Format
from mumoe_tn.decompositions.mxd import MxDFormat, mxd
from mumoe_tn.decompositions.registry import (
    available,
    build,
    get_format,
    normalise_ranks,
    register,
    unregister,
)
from mumoe_tn.decompositions.resolve import (
    Decomposition,
    Rank,
    format_of,
    is_spec,
    resolve_network,
    spec_ranks,
    split_spec_name,
)
from mumoe_tn.decompositions.tr import TRFormat, tr
from mumoe_tn.decompositions.tt import TTFormat, tt
from mumoe_tn.decompositions.tucker import TuckerFormat, tucker

__all__ = [
    "CPFormat",
    "Decomposition",
    "Format",
    "MxDFormat",
    "Rank",
    "TRFormat",
    "TTFormat",
    "TuckerFormat",
    "available",
    "build",
    "cp",
    "format_of",
    "get_format",
    "is_spec",
    "mxd",
    "normalise_ranks",
    "register",
    "resolve_network",
    "spec_ranks",
    "split_spec_name",
    "tr",
    "tt",
    "tucker",
    "unregister",
]
