"""Streaming a model's MLP-block activations: which blocks, their input/output pairs, a bounded buffer.

Distillation and its evaluation read the blocks of a model as functions ``x ↦ y`` of their
input. [`select_blocks`][mumoe_tn.distillation.streaming.select_blocks] finds them by name as
[`convert`][mumoe_tn.conversion.convert.convert] does;
[`capture_blocks`][mumoe_tn.distillation.streaming.capture_blocks] records their inputs and outputs
during one forward pass of the model;
[`ActivationBuffer`][mumoe_tn.distillation.streaming.ActivationBuffer] holds real tokens only (padding
dropped) in storage allocated once for a fixed number of rows, so a stream of any length never holds
more than that.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mumoe_tn.conversion.surgery.block_kinds import BlockKind, block_kind
from mumoe_tn.conversion.surgery.blocks import mlp_parts
from mumoe_tn.distillation.corpus import MAX_TEXT_BYTES, encode_text, read_text
from mumoe_tn.masking import token_mask
from mumoe_tn.validation import check_size

__all__ = [
    "ActivationBuffer",
    "Batch",
    "BlockInfo",
    "TokenWindows",
    "capture_blocks",
    "harvest",
    "one_kernel_activation",
    "run_model",
    "select_blocks",
    "token_rows",
]

#: A batch of the text stream: a tensor of token ids, or the keyword arguments of the model's forward.
Batch = torch.Tensor | Mapping[str, Any]


@dataclass(frozen=True)
class BlockInfo:
    """An MLP block chosen for distillation: what a replacement factory is given.

    Attributes
    ----------
    name : str
        Qualified module name in the model.
    module : nn.Module
        The block itself (its forward maps the input ``(…, I)`` to the output ``(…, O)``).
    kind : BlockKind
        A plain two-layer block or a gated (SwiGLU/GeGLU) one (a name is looked up in
        [`BLOCK_KINDS`][mumoe_tn.conversion.surgery.block_kinds.BLOCK_KINDS]).
    in_features, hidden_features, out_features : int
        ``I``, ``H`` and ``O``.
    bias : bool
        Whether the block's layers have biases.
    activation : nn.Module or None
        The block's non-linearity, as one torch kernel where one computes the same function (see
        [`one_kernel_activation`][mumoe_tn.distillation.streaming.one_kernel_activation]).
    device : torch.device
    dtype : torch.dtype
        Where and in what dtype the block's weights live.
    """

    name: str
    module: nn.Module
    kind: BlockKind
    in_features: int
    hidden_features: int
    out_features: int
    bias: bool
    activation: nn.Module | None
    device: torch.device
    dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", block_kind(self.kind))

    @property
    def parameters(self) -> int:
        """Parameters of the block's linear layers."""
        return sum(p.numel() for p in self.module.parameters())


def select_blocks(model: nn.Module, mlps: str | Callable[[str, nn.Module], bool] = r"mlp$") -> list[BlockInfo]:
    """The MLP blocks of ``model`` chosen by ``mlps``, in module order.

    Parameters
    ----------
    model : nn.Module
        The model.
    mlps : str or Callable, optional
        A regex searched in the qualified module name (default ``"mlp$"``), or a predicate
        ``(name, module) -> bool``, applied to the modules
        [`find_mlp_blocks`][mumoe_tn.conversion.convert.find_mlp_blocks] lists.

    Returns
    -------
    list of BlockInfo

    Raises
    ------
    ValueError
        An invalid regex; nothing selected; a selected block split across sibling modules
        (BERT-style), which has no single module mapping input to output.
    """
    if isinstance(mlps, str):
        try:
            pattern = re.compile(mlps)
        except re.error as error:
            raise ValueError(f"mlps= is not a valid regular expression: {mlps!r} ({error})") from None
        chosen: Callable[[str, nn.Module], bool] = lambda name, module: pattern.search(name) is not None  # noqa: E731
    elif callable(mlps):
        chosen = mlps
    else:
        raise TypeError(f"mlps= must be a regex string or a callable (name, module) -> bool, got {mlps!r}")
    blocks = []
    for name, module in model.named_modules():
        parts = mlp_parts(module) if name else None
        if parts is None or not chosen(name, module):
            continue
        if parts.kind.split:
            raise ValueError(
                f"{name!r} is an MLP split across the sibling modules {parts.replaced}: distillation needs one module "
                "that maps the block's input to its output; select that module (or wrap the two in one)"
            )
        up, down = parts.layers["up"], parts.layers["down"]
        bias = any(view.bias is not None for view in parts.layers.values())
        blocks.append(
            BlockInfo(
                name, module, parts.kind, up.in_features, up.out_features, down.out_features, bias,
                one_kernel_activation(parts.activation), up.device, up.dtype,
            )
        )  # fmt: skip
    if not blocks:
        raise ValueError(
            f"no MLP block was selected by mlps={mlps!r}; the model's MLP blocks are found by find_mlp_blocks"
        )
    return blocks


#: transformers' tanh-approximated GELUs, ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`` written as
#: six elementwise ops (and as many in the backward pass): torch computes the same function in one.
_TANH_GELUS = frozenset({"NewGELUActivation", "FastGELUActivation"})


def one_kernel_activation(activation: nn.Module | None) -> nn.Module | None:
    """``activation``, or torch's one-kernel module computing the same function (a replacement's hot path).

    transformers' tanh-approximated GELUs (GPT-2's ``gelu_new``) become
    ``nn.GELU(approximate="tanh")``: equal up to float rounding, and a third of the time forward and
    backward on a step's hidden activations. Any other module is returned as it is.
    """
    kind = type(activation)
    if activation is not None and kind.__module__.startswith("transformers.") and kind.__name__ in _TANH_GELUS:
        return nn.GELU(approximate="tanh")
    return activation


def token_rows(batch: Batch, mask_argument: str | None) -> tuple[dict[str, Any], torch.Tensor | None]:
    """The keyword arguments of the model's forward for ``batch``, and its token mask (None: all real).

    A tensor batch is ``{"input_ids": batch}``; a mapping is passed as it is, its
    ``mask_argument`` entry (True/1 = real token) being the mask.
    """
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch}, None
    if not isinstance(batch, Mapping):
        raise TypeError(
            "a batch must be a tensor of token ids or a mapping of the model's keyword arguments, "
            f"got {type(batch).__name__}"
        )
    mask = None if mask_argument is None else batch.get(mask_argument)
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"the batch's {mask_argument!r} must be a tensor, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ValueError(f"the batch's {mask_argument!r} must hold True/False or 1/0 (1 = real token)")
            mask = mask != 0
    return dict(batch), mask


def run_model(model: nn.Module, kwargs: Mapping[str, Any], mask: torch.Tensor | None) -> Any:
    """Call ``model(**kwargs)`` with ``mask`` handed to any μMoE layer inside (see `mumoe_tn.masking`)."""
    with token_mask(mask):
        return model(**kwargs)


@contextmanager
def capture_blocks(model: nn.Module, names: Sequence[str]) -> Iterator[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Record the input and output of the named modules at every forward pass inside the block.

    Yields a dict, filled by each forward pass, of name -> ``(x, y)`` (detached). The hooks
    are removed on exit.
    """
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name: str) -> Callable:
        def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            inputs = [*args, *kwargs.values()]
            x = next((value for value in inputs if isinstance(value, torch.Tensor)), None)
            y = output[0] if isinstance(output, tuple) else output
            if x is None or not isinstance(y, torch.Tensor):
                raise TypeError(f"{name!r} must take a tensor and return a tensor to be distilled")
            captured[name] = (x.detach(), y.detach())

        return record

    handles = [model.get_submodule(name).register_forward_hook(hook(name), with_kwargs=True) for name in names]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


class ActivationBuffer:
    """Input/output rows of several blocks, at most ``capacity`` tokens, in storage allocated once.

    Rows are added for every block at once (the same tokens), read from the front and shuffled
    in place. The storage is ``capacity × (I + O)`` per block, allocated at the first
    [`add`][mumoe_tn.distillation.streaming.ActivationBuffer.add]; adding more than fits is an error.

    Parameters
    ----------
    capacity : int
        Most tokens held.

    Attributes
    ----------
    peak_rows : int
        The most tokens held at any time.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = check_size("capacity", capacity)
        self._x: dict[str, torch.Tensor] = {}
        self._y: dict[str, torch.Tensor] = {}
        self._start = self._end = 0
        self.peak_rows = 0
        self.shuffled = False

    @property
    def rows(self) -> int:
        """Tokens held now."""
        return self._end - self._start

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the storage (fixed once allocated)."""
        tensors = [*self._x.values(), *self._y.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def add(self, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append rows: ``block -> (x, y)`` of shapes ``(n, I)`` and ``(n, O)``, the same ``n`` for every block."""
        counts = {x.shape[0] for x, _ in pairs.values()} | {y.shape[0] for _, y in pairs.values()}
        if len(counts) != 1:
            raise ValueError(f"every block must add the same number of rows, got {sorted(counts)}")
        (n,) = counts
        if self.rows + n > self.capacity:
            raise ValueError(f"adding {n} rows to {self.rows} exceeds the buffer's capacity of {self.capacity}")
        if not self._x:
            for name, (x, y) in pairs.items():
                self._x[name] = x.new_empty((self.capacity, x.shape[-1]))
                self._y[name] = y.new_empty((self.capacity, y.shape[-1]))
        elif set(pairs) != set(self._x):
            raise ValueError(f"rows must be added for the blocks {sorted(self._x)}, got {sorted(pairs)}")
        if self._end + n > self.capacity:  # move the rows held to the front
            for store in (*self._x.values(), *self._y.values()):
                store[: self.rows] = store[self._start : self._end].clone()
            self._start, self._end = 0, self.rows
        for name, (x, y) in pairs.items():
            self._x[name][self._end : self._end + n] = x
            self._y[name][self._end : self._end + n] = y
        self._end += n
        self.peak_rows = max(self.peak_rows, self.rows)
        self.shuffled = False

    def shuffle(self, generator: torch.Generator) -> None:
        """Permute the rows held (the same permutation for every block)."""
        order = torch.randperm(self.rows, generator=generator) + self._start
        for store in (*self._x.values(), *self._y.values()):
            store[self._start : self._end] = store[order.to(store.device)]
        self.shuffled = True

    def take(self, n: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Remove and return the first ``n`` rows of every block (copies)."""
        if not 0 < n <= self.rows:
            raise ValueError(f"cannot take {n} rows from a buffer holding {self.rows}")
        rows = slice(self._start, self._start + n)
        out = {name: (self._x[name][rows].clone(), self._y[name][rows].clone()) for name in self._x}
        self._start += n
        return out

    def state_dict(self) -> dict[str, Any]:
        """The rows held (not the free storage), for a checkpoint."""
        rows = slice(self._start, self._end)
        return {
            "x": {name: t[rows].clone() for name, t in self._x.items()},
            "y": {name: t[rows].clone() for name, t in self._y.items()},
            "peak_rows": self.peak_rows,
            "shuffled": self.shuffled,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Hold the rows of ``state`` (what ``state_dict`` returned)."""
        self._x, self._y, self._start, self._end = {}, {}, 0, 0
        pairs = {name: (state["x"][name], state["y"][name]) for name in state["x"]}
        if pairs and next(iter(pairs.values()))[0].shape[0] > 0:
            self.add(pairs)
        self.peak_rows = int(state["peak_rows"])
        self.shuffled = bool(state["shuffled"])


def harvest(
    model: nn.Module,
    stream: Iterator[Batch],
    names: Sequence[str],
    buffer: ActivationBuffer,
    *,
    mask_argument: str | None,
    done: Callable[[], bool],
    make_room: Callable[[int], None],
    before_batch: Callable[[], None],
    added: Callable[[Batch], None],
) -> None:
    """Run ``model`` on the batches of ``stream`` and add the blocks' real rows to ``buffer``, until ``done()``.

    Parameters
    ----------
    model : nn.Module
        The model (run without gradients, in the mode it is in).
    stream : Iterator
        The batches (see ``token_rows``).
    names : Sequence of str
        The blocks whose input/output rows to keep.
    buffer : ActivationBuffer
    mask_argument : str or None
        The key of a mapping batch that marks real tokens.
    done : Callable[[], bool]
        Asked before every batch and after every ``make_room``: stop once it says True.
    make_room : Callable[[int], None]
        ``make_room(rows)`` trains on the buffer until it holds at most ``rows`` rows, called when the
        next batch does not fit.
    before_batch : Callable[[], None]
        Called before every batch is read (a stop request raises from it).
    added : Callable[[Batch], None]
        Called with every batch added to the buffer (a checkpoint written by ``make_room`` counts
        the batches read).

    Raises
    ------
    ValueError
        If a batch holds more real tokens than the buffer, or a block did not run.
    """
    capacity = buffer.capacity
    with capture_blocks(model, names) as captured, torch.no_grad():
        while not done():
            before_batch()
            batch = next(stream, None)
            if batch is None:
                break
            kwargs, mask = token_rows(batch, mask_argument)
            ids = next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            needed = int(mask.sum()) if mask is not None else ids.numel()
            if needed > capacity:
                raise ValueError(
                    f"a batch of {needed} tokens does not fit the buffer of {capacity}: raise buffer_tokens"
                )
            if buffer.rows + needed > capacity:
                make_room(min(capacity // 2, capacity - needed))
                if done():
                    break
            captured.clear()
            run_model(model, kwargs, mask)
            missing = [name for name in names if name not in captured]
            if missing:
                raise ValueError(f"the blocks {missing} did not run in the model's forward pass")
            buffer.add({name: _real_rows(captured[name], mask) for name in names})
            added(batch)


def _real_rows(pair: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` flattened to ``(tokens, features)`` rows, padding dropped."""
    x, y = pair
    x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    if mask is None:
        return x, y
    keep = mask.reshape(-1).to(x.device)
    if keep.numel() != x.shape[0]:
        raise ValueError(f"the token mask has {keep.numel()} entries but the block saw {x.shape[0]} tokens")
    return x[keep], y[keep]


class TokenWindows:
    """Batches of random windows of a token sequence, the same ones at every iteration (re-iterable).

    Each iteration draws ``batches`` batches of ``batch_size`` windows of ``context`` tokens from
    ``tokens`` with a generator seeded by ``seed``, so a resumed distillation reads the same
    stream again.

    Parameters
    ----------
    tokens : torch.Tensor
        A 1-D tensor of token ids.
    context, batch_size, batches : int
        Window length, windows per batch, batches per iteration.
    seed : int, optional
        Seed of the window positions.
    """

    def __init__(self, tokens: torch.Tensor, context: int, batch_size: int, batches: int, *, seed: int = 0) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.ndim != 1:
            raise TypeError(f"tokens must be a 1-D tensor of token ids, got {tokens!r:.80}")
        self.context, self.batch_size = check_size("context", context), check_size("batch_size", batch_size)
        self.batches = check_size("batches", batches)
        if tokens.numel() <= context:
            raise ValueError(f"the text has {tokens.numel()} tokens, not more than one window of context={context}")
        self.tokens, self.seed = tokens, seed

    @classmethod
    def from_text(
        cls,
        paths: str | os.PathLike | Iterable[str | os.PathLike],
        context: int,
        batch_size: int,
        batches: int,
        *,
        tokenizer: Any = None,
        vocab_size: int | None = None,
        seed: int = 0,
        max_bytes: int = MAX_TEXT_BYTES,
    ) -> TokenWindows:
        """Windows of the text in UTF-8 files (see [`mumoe_tn.distillation.corpus`][mumoe_tn.distillation.corpus]).

        Parameters
        ----------
        paths : path or sequence of paths
            Text files, and directories of ``.txt`` / ``.md`` files (read sorted).
        context, batch_size, batches : int
            As for the constructor.
        tokenizer : object, optional
            Anything with ``encode(text) -> Sequence[int]``, e.g. the model's Hugging Face
            tokenizer; None (default) for one token per byte.
        vocab_size : int, optional
            The model's vocabulary, which every token id must fit.
        seed : int, optional
            Seed of the window positions.
        max_bytes : int, optional
            The most bytes of text read (default 64 MiB).
        """
        tokens = encode_text(read_text(paths, max_bytes=max_bytes), tokenizer, vocab_size=vocab_size)
        return cls(tokens, context, batch_size, batches, seed=seed)

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(self.batches):
            starts = torch.randint(0, self.tokens.numel() - self.context, (self.batch_size,), generator=generator)
            yield torch.stack([self.tokens[s : s + self.context] for s in starts.tolist()])
