"""Per-token coefficient tables of sequence models: every token's coefficients, keyed by sequence and position.

[`token_coefficients`][mumoe_tn.analysis.tokens.token_coefficients] runs a model over token
sequences and keeps one layer's coefficients per token, so an expert's top tokens come with
their sequence, position and a window of context — no row arithmetic. It keeps every token's
coefficients (``tokens × N`` per mode); for a large dataset use
[`collect_coefficients`][mumoe_tn.analysis.coefficients.collect_coefficients] (streaming top-k)
or [`explore`][mumoe_tn.analysis.explorer.explore].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mumoe_tn.analysis.layer_checks import check_layer_in_model
from mumoe_tn.analysis.outputs import decoder
from mumoe_tn.analysis.progress import check_progress
from mumoe_tn.analysis.progress import progress as progress_bar
from mumoe_tn.layers import MuMoEBase
from mumoe_tn.validation import check_callable, check_int, check_tensor

__all__ = ["TokenCoefficients", "token_coefficients"]


@dataclass
class TokenCoefficients:
    """One layer's coefficients for every token of a set of sequences.

    Attributes
    ----------
    tokens : torch.Tensor
        Token ids, ``(sequences, positions)``.
    coefficients : list of torch.Tensor
        Per expert mode, ``(sequences, positions, N_e)``.
    decode : Callable
        ``token id -> text``.
    threshold : float
        A token is active for an expert when its coefficient is at least this.
    """

    tokens: torch.Tensor
    coefficients: list[torch.Tensor]
    decode: Callable[[int], str]
    threshold: float = 1e-6

    def _check(self, expert: int, mode: int) -> None:
        mode = check_int("mode", mode, minimum=0)
        if mode >= len(self.coefficients):
            raise ValueError(f"mode must be below {len(self.coefficients)} (the layer's expert modes), got {mode}")
        expert = check_int("expert", expert, minimum=0)
        if expert >= self.coefficients[mode].shape[-1]:
            raise ValueError(f"expert must be below {self.coefficients[mode].shape[-1]} in mode {mode}, got {expert}")

    def top(self, expert: int, *, mode: int = 0, k: int = 10, context: int = 8) -> list[dict[str, object]]:
        """Expert ``expert``'s ``k`` most activating tokens (active ones only), largest coefficient first.

        Each row: ``sequence``, ``position``, ``token`` (id), ``text``, ``before`` / ``after`` (up to
        ``context`` tokens of text on each side) and ``coefficient``.
        """
        self._check(expert, mode)
        k = check_int("k", k, minimum=0)
        context = check_int("context", context, minimum=0)
        values = self.coefficients[mode][..., expert].reshape(-1)
        count = min(k, int((values >= self.threshold).sum()))
        top = values.topk(count)
        width = self.tokens.shape[1]
        rows = []
        for value, flat in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            s, p = divmod(flat, width)
            sequence = self.tokens[s].tolist()
            rows.append(
                {
                    "sequence": s,
                    "position": p,
                    "token": sequence[p],
                    "text": self.decode(sequence[p]),
                    "before": "".join(self.decode(t) for t in sequence[max(0, p - context) : p]),
                    "after": "".join(self.decode(t) for t in sequence[p + 1 : p + 1 + context]),
                    "coefficient": value,
                }
            )
        return rows

    def dead(self, mode: int = 0) -> torch.Tensor:
        """Experts of ``mode`` active on no token."""
        self._check(0, mode)
        return ((self.coefficients[mode] >= self.threshold).flatten(0, -2).sum(0) == 0).nonzero().flatten()

    def to_markdown(self, expert: int, *, mode: int = 0, k: int = 10, context: int = 8) -> str:
        """``top(...)`` as a Markdown table; the token in bold between its context."""
        lines = ["| sequence | position | token | in context | coefficient |", "|---:|---:|---|---|---:|"]

        def cell(text: str) -> str:
            return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "⏎").replace("*", "\\*")

        for row in self.top(expert, mode=mode, k=k, context=context):
            lines.append(
                f"| {row['sequence']} | {row['position']} | `{cell(str(row['text']))}` | "
                f"{cell(str(row['before']))}**{cell(str(row['text']))}**{cell(str(row['after']))} | "
                f"{row['coefficient']:.3g} |"
            )
        return "\n".join(lines)

    def plot(self, expert: int, *, mode: int = 0, path: str | None = None, bins: int = 30):
        """Histogram of the expert's coefficients over the active tokens; saved to ``path`` if given."""
        import matplotlib.pyplot as plt

        self._check(expert, mode)
        values = self.coefficients[mode][..., expert].reshape(-1)
        active = values[values >= self.threshold]
        figure, ax = plt.subplots(figsize=(5, 2.5))
        ax.hist(active.double().numpy(), bins=bins, color="#2e86c1")
        ax.set_xlabel("coefficient")
        ax.set_ylabel("tokens")
        ax.set_title(f"mode {mode} expert {expert}: active on {active.numel()} of {values.numel()} tokens", fontsize=9)
        figure.tight_layout()
        if path is not None:
            figure.savefig(path, dpi=120)
        return figure


@torch.no_grad()
def token_coefficients(
    model: nn.Module,
    layer: MuMoEBase,
    sequences: torch.Tensor,
    *,
    vocabulary: Sequence[str] | Callable[[int], str] | None = None,
    batch_size: int = 32,
    threshold: float = 1e-6,
    forward: Callable[[nn.Module, torch.Tensor], object] | None = None,
    progress: bool | None = None,
) -> TokenCoefficients:
    """Run ``model`` over token ``sequences`` and keep ``layer``'s coefficients per token.

    Parameters
    ----------
    model : nn.Module
        A sequence model containing ``layer``, called as ``model(batch)`` on ``(batch, positions)``
        token ids (or through ``forward``); evaluated in ``eval()`` mode (restored after).
    layer : MuMoEBase
        The layer whose coefficients are kept; it must see inputs ``(batch, positions, features)``.
    sequences : torch.Tensor
        Token ids, ``(sequences, positions)``.
    vocabulary : sequence of str or Callable, optional
        Decodes token ids to text (a list indexed by id, or e.g. ``tokenizer.decode``).
    batch_size : int, optional
        Sequences per forward pass.
    threshold : float, optional
        The load threshold (as in ``collect_coefficients``).
    forward : Callable, optional
        ``forward(model, batch)`` if the model is not simply called.
    progress : bool, optional
        Show a progress bar (tqdm, on stderr); by default only on a terminal.

    Returns
    -------
    TokenCoefficients
    """
    model, layer = check_layer_in_model(model, layer)
    sequences = check_tensor("sequences", sequences, ndim=2, kind="int", non_empty=True)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    check_callable("forward", forward)
    check_progress(progress)
    decode = decoder(vocabulary)
    captured: list[tuple[torch.Tensor, ...]] = []

    def record(module: nn.Module, args: tuple, output: object) -> None:
        captured.append(tuple(a.detach().float().cpu() for a in module.last_coefficients))

    chunks = list(sequences.split(batch_size))
    parts: list[list[torch.Tensor]] = []
    handle = layer.register_forward_hook(record)
    was_training = model.training
    model.eval()
    try:
        for chunk in progress_bar(chunks, "token coefficients", enabled=progress):
            captured.clear()
            forward(model, chunk) if forward else model(chunk)
            if len(captured) != 1:
                raise ValueError(f"the layer ran {len(captured)} times on one batch; expected once per batch")
            shapes = [tuple(a.shape[:-1]) for a in captured[0]]
            if any(shape != tuple(chunk.shape) for shape in shapes):
                raise ValueError(
                    f"the layer's coefficients have leading shape {shapes[0]}, not the batch's {tuple(chunk.shape)} "
                    "(one row per token): token tables need a layer applied per token"
                )
            parts.append(list(captured[0]))
    finally:
        handle.remove()
        model.train(was_training)
    coefficients = [torch.cat(mode) for mode in zip(*parts, strict=True)]
    return TokenCoefficients(sequences.detach().cpu(), coefficients, decode, threshold)
