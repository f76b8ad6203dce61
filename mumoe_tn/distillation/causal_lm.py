"""What a distillation reads from a saved Hugging Face causal LM: its context length and its tokenizer.

Model families name their context length differently in their configs — GPT-2 ``n_positions``,
Llama, Mistral, Qwen, GPT-NeoX (Pythia) and Gemma ``max_position_embeddings``, others ``n_ctx``,
``seq_length`` or ``max_sequence_length``; [`context_length`][mumoe_tn.distillation.causal_lm.context_length]
reads whichever the config has. [`saved_tokenizer`][mumoe_tn.distillation.causal_lm.saved_tokenizer]
loads the tokenizer saved beside a model, if there is one, from that directory only: every file
it may read is first checked to be a regular file of one link inside it (a link out is refused).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["CONTEXT_FIELDS", "TOKENIZER_FILES", "TOKENIZER_READS", "context_length", "saved_tokenizer"]

CONTEXT_FIELDS = ("n_positions", "max_position_embeddings", "n_ctx", "seq_length", "max_sequence_length")
"""The config fields that hold a model's context length, in the order they are read."""

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")
"""Files of a tokenizer saved with ``save_pretrained``: any of them beside a model means it has one."""

TOKENIZER_READS = (
    *TOKENIZER_FILES, "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "merges.txt",
    "vocab.txt", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json", "config.json",
)  # fmt: skip
"""The files ``AutoTokenizer`` may read from a model's directory: each present is checked first."""


def context_length(config: Any) -> int:
    """The most tokens a model of ``config`` reads at once, whatever field its family keeps it in.

    Parameters
    ----------
    config : object
        A model's config (a ``transformers.PretrainedConfig``, or any object with the fields as
        attributes).

    Returns
    -------
    int
        The first of [`CONTEXT_FIELDS`][mumoe_tn.distillation.causal_lm.CONTEXT_FIELDS] the config sets
        to a positive int.

    Raises
    ------
    ValueError
        A config setting none of them, naming the fields looked for.
    """
    for name in CONTEXT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise ValueError(
        f"the model's config ({type(config).__name__}) gives no context length: none of the fields "
        f"{', '.join(CONTEXT_FIELDS)} is a positive int"
    )


def saved_tokenizer(directory: str | Path) -> Any | None:
    """The tokenizer saved in ``directory`` beside a model (local files only), or None if there is none.

    Parameters
    ----------
    directory : str or Path
        A model's directory; a tokenizer is there when it holds one of
        [`TOKENIZER_FILES`][mumoe_tn.distillation.causal_lm.TOKENIZER_FILES].

    Returns
    -------
    transformers tokenizer or None

    Raises
    ------
    ValueError
        If a file the tokenizer reads ([`TOKENIZER_READS`][mumoe_tn.distillation.causal_lm.TOKENIZER_READS])
        leads outside ``directory``, is not a regular file, has another hard link or is over
        [`MAX_JSON_BYTES`][mumoe_tn.conversion.persistence.files].
    """
    directory = Path(directory)
    if not any(os.path.lexists(directory / name) for name in TOKENIZER_FILES):
        return None
    from mumoe_tn.conversion.persistence.files import check_json_files  # torch: imported only when a tokenizer is there

    check_json_files(directory, TOKENIZER_READS)  # regular files of one link inside, each of at most 64 MiB
    import transformers

    return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
