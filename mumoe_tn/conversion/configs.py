"""A checkpoint's ``config.json`` held against its weights before transformers builds anything from it.

transformers builds the model its config describes, then loads the weights into it: a config
declaring a vocabulary of 16 M or 6,000 layers costs gigabytes or minutes before the weights are
found not to fit, and a dtype name it does not know reaches torch. Before
[`load_converted`][mumoe_tn.conversion.checkpoints.load_converted] hands a directory to
transformers, [`check_config`][mumoe_tn.conversion.configs.check_config] checks:

- ``dtype`` / ``torch_dtype``: null or one of [`DTYPES`][mumoe_tn.conversion.configs];
- every layer count ([`LAYER_COUNTS`][mumoe_tn.conversion.configs]): at most the number of numbered
  modules the weights hold (a layer ``k`` is a key ``….k.…``);
- every width ([`WIDTHS`][mumoe_tn.conversion.configs]): at most the largest dimension of a stored
  tensor (a vocabulary, hidden or position size sizes a tensor the checkpoint then stores);
  ``max_position_embeddings`` may also be up to [`MAX_UNSTORED_POSITIONS`][mumoe_tn.conversion.configs]
  (rotary models declare positions they never store).

Each refusal is a ``ValueError`` naming the field and quoting the value, shortened.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from mumoe_tn.conversion.files import Headers

__all__ = ["DTYPES", "LAYER_COUNTS", "MAX_UNSTORED_POSITIONS", "WIDTHS", "check_config"]

#: The dtype names a converted checkpoint's config may give (what its floating weights may be).
DTYPES = ("float32", "float16", "bfloat16", "float64")
#: Config fields that count layers.
LAYER_COUNTS = ("n_layer", "num_hidden_layers", "num_layers", "n_layers", "num_decoder_layers")
#: Config fields that size a dimension of some tensor.
WIDTHS = (
    "vocab_size", "hidden_size", "n_embd", "d_model", "intermediate_size", "n_inner", "n_positions",
    "max_position_embeddings", "num_attention_heads", "n_head", "num_key_value_heads", "head_dim", "d_ff",
)  # fmt: skip
#: Largest ``max_position_embeddings`` accepted beyond the stored dimensions.
MAX_UNSTORED_POSITIONS = 1 << 17

_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def _refuse(field: str, value: object, rule: str) -> ValueError:
    return ValueError(f"config.json: {field} = {repr(value)[:120]} is invalid: {rule}")


def check_config(config: Mapping[str, object], headers: Headers) -> None:
    """Check a checkpoint's config against its weights' headers (see the module's docstring).

    Parameters
    ----------
    config : Mapping
        The parsed ``config.json``.
    headers : Headers
        Shapes and dtypes of every stored tensor, by key.

    Raises
    ------
    ValueError
        Naming the first field that breaks its rule.
    """
    for field in ("dtype", "torch_dtype"):
        value = config.get(field)
        if value is not None and (not isinstance(value, str) or value not in DTYPES):
            raise _refuse(field, value, f"a converted checkpoint's dtype is null or one of {list(DTYPES)}")
    widest = max((size for shape, _ in headers.values() for size in shape), default=0)
    layers = 0
    for key in headers:
        for index in _INDEX.findall(key):
            if len(index) < 10:
                layers = max(layers, int(index) + 1)
    for field in LAYER_COUNTS:
        value = config.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _refuse(field, value, "a layer count is a non-negative int")
        if value > max(layers, 1):
            raise _refuse(
                field, value, f"the weights hold {layers} numbered layer(s) at most: the config does not fit them"
            )
    for field in WIDTHS:
        value = config.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _refuse(field, value, "a size is a non-negative int")
        bound = max(widest, MAX_UNSTORED_POSITIONS) if field == "max_position_embeddings" else widest
        if value > bound:
            raise _refuse(
                field, value, f"no stored tensor has a dimension above {widest:,}: the config does not fit the weights"
            )
