"""Every bound a loaded file is held to: sizes, counts, lengths and allow-lists, in one place.

A checkpoint, its ``config.json`` and its conversion record are data from anywhere, so every
reader in [`mumoe_tn.conversion.persistence`][mumoe_tn.conversion.persistence] checks what it
reads against a limit before it does work in proportion to it (allocates, parses, plans,
builds) and refuses anything outside an allow-list. The limits are here and nowhere else in the
persistence: each reader imports the ones it holds a file to, so a reviewer reads this page to
know the most any file can cost. Each bound is far above what a real model needs (the reason is
given with it) and far below what would exhaust a machine. This module imports nothing.
"""

__all__ = [
    "DTYPES",
    "EXECUTION_OPTIONS",
    "JSON_FILES",
    "MAX_CHECKPOINT_TENSORS",
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_FIELDS",
    "MAX_CONFIG_VALUES",
    "MAX_CORE_ELEMENTS",
    "MAX_GATE_LIST",
    "MAX_GATE_STRING",
    "MAX_JSON_BYTES",
    "MAX_LABELS",
    "MAX_LABEL_CHARS",
    "MAX_LABEL_ID_DIGITS",
    "MAX_LAYER_INDEX_DIGITS",
    "MAX_LISTED_KEYS",
    "MAX_MASK_ARGUMENT_CHARS",
    "MAX_MESSAGE_CHARS",
    "MAX_NAME_CHARS",
    "MAX_NETWORK_WORK",
    "MAX_PICKLE_BYTES",
    "MAX_RECORD_CORES",
    "MAX_RECORD_MODULES",
    "MAX_RECORD_PAD",
    "MAX_RECORD_PATHS",
    "MAX_RECORD_PLANS",
    "MAX_RECORD_SIZE",
    "MAX_UNSTORED_POSITIONS",
    "PICKLED_FILES",
    "RECORD_VERSION",
    "SAFETENSORS_FILES",
    "SHARED_ALLOWANCE",
    "SHARED_SLACK_BYTES",
    "STOCK_WEIGHT_FILES",
    "STORED_DTYPES",
]

# ----------------------------------------------------------------------------- the conversion record
RECORD_VERSION = 1
"""Latest layout of the conversion record this mumoe_tn reads (and the one it writes); a later version is refused."""

MAX_RECORD_MODULES = 1 << 16
"""Most replaced modules one record may list (a converted 70B-parameter model replaces a few hundred)."""

MAX_RECORD_PATHS = 1 << 16
"""Most paths one recorded module may sit at (a module shared by several parents has one per parent)."""

MAX_RECORD_CORES = 256
"""Most cores one recorded network may have (planning a network takes time that grows with its cores)."""

MAX_RECORD_SIZE = 1 << 40
"""Largest size of one label a record may give, and largest ``chunk_size`` (a tensor of it would not fit any device)."""

MAX_CORE_ELEMENTS = 1 << 59
"""Most elements one recorded core may hold (2⁶² bytes in float64: beyond any device, short of torch's storage-size
overflow)."""

MAX_NETWORK_WORK = 1 << 19
"""Most work one recorded network may ask of the checks and the planner.

Its cores × its labels × the most cores one label joins: a 256-core chain is 2¹⁷, a CP network of
ten modes about 2⁹.
"""

MAX_NAME_CHARS = 1024
"""Longest name a record may give a core, a label or a module path."""

MAX_MASK_ARGUMENT_CHARS = 256
"""Longest name of the ``forward`` argument a record says carries the token mask."""

MAX_GATE_LIST = 64
"""Most values a list field of a recorded gate descriptor may hold."""

MAX_GATE_STRING = 256
"""Longest string a recorded gate field may hold."""

EXECUTION_OPTIONS = ("optimize", "max_plans", "chunk_size", "recompute", "precontract", "pad_bonds")
"""The execution options of a factorized layer a record may carry; any other key is refused."""

MAX_RECORD_PLANS = 1 << 20
"""Largest ``max_plans`` a record may give (the plan cache's slots; the library's default is 64)."""

MAX_RECORD_PAD = 1024
"""Largest ``pad_bonds`` a record may give (bonds are padded to a multiple of it; the library's default is 16)."""

# ----------------------------------------------------------------------------- config.json
MAX_CONFIG_BYTES = 16 << 20
"""Largest ``config.json`` read (a record of thousands of modules is a few MB)."""

MAX_CONFIG_FIELDS = 512
"""Most top-level fields a config may have (transformers' configs have 30 to 150)."""

MAX_CONFIG_VALUES = 1 << 17
"""Most values nested anywhere in a config's fields, the conversion record apart (it has its own bounds)."""

MAX_LABELS = 1 << 15
"""Most labels ``num_labels``, ``id2label`` and ``label2id`` may give."""

MAX_LABEL_CHARS = 256
"""Longest label name."""

MAX_LABEL_ID_DIGITS = 9
"""Most digits of an ``id2label`` key read as a label id (a longer key is no label below ``MAX_LABELS``)."""

MAX_LAYER_INDEX_DIGITS = 18
"""Most digits of a weight's layer index read as a number; a longer index counts as beyond every layer."""

MAX_UNSTORED_POSITIONS = 1 << 17
"""Largest ``max_position_embeddings`` accepted beyond the stored dimensions (rotary models store none)."""

DTYPES = ("float32", "float16", "bfloat16", "float64")
"""The dtype names a converted checkpoint's config may give (what its floating weights may be)."""

# ----------------------------------------------------------------------------- files
MAX_JSON_BYTES = 64 << 20
"""Largest JSON file of a checkpoint read (``config.json``, a shard index; a record of thousands of modules is a few
MB)."""

JSON_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
"""The JSON files transformers reads from a model directory besides the weights: each is checked before any is read."""

SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
"""The safetensors weights of a checkpoint directory: one file, or a shard index naming files inside the directory."""

PICKLED_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
"""The pickled weights of a checkpoint directory (read only if it has no safetensors weights)."""

STOCK_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
"""The unsharded weight files stock ``from_pretrained`` looks for in a directory (a shard index is one of
``JSON_FILES``)."""

STORED_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool",
}  # fmt: skip
"""The dtypes a safetensors header may give, with the torch dtype each is read as; any other is refused."""

# ----------------------------------------------------------------------------- stored tensors
MAX_CHECKPOINT_TENSORS = 1 << 16
"""Most tensors one weight file or checkpoint may hold.

A converted 70B-parameter model holds a few thousand; every key costs time to unpickle, check and
match, whatever its size.
"""

MAX_PICKLE_BYTES = 16 << 20
"""Largest pickle a pickled weight file may hold.

About 150 bytes a tensor, so ``MAX_CHECKPOINT_TENSORS`` fit; unpickling takes time in its length
before any tensor can be counted.
"""

SHARED_ALLOWANCE = 2
"""How many times its own size a weight file's tensors may declare together.

Tied weights (one storage at two keys, as an embedding shared with the output layer) count twice.
"""

SHARED_SLACK_BYTES = 4096
"""Bytes a file's tensors may declare beyond ``SHARED_ALLOWANCE`` times its size (a tiny file's headers outweigh its
data)."""

# ----------------------------------------------------------------------------- messages
MAX_MESSAGE_CHARS = 2000
"""Longest message of a refusal (a field's value is quoted shortened; so is anything it quotes)."""

MAX_LISTED_KEYS = 10
"""Most keys an error message lists (then "and N more")."""
