"""The specialisation study, an experiment of the paper: expert class-polysemanticity against the number of experts.

The paper (Section "Expert specialism", the polysemanticity measure and its footnote, appendix
ablations) fine-tunes CP μMoE final layers on CLIP/DINO features over ImageNet's 1,000 classes,
ablates every expert in turn, and reports that the mean class-level polysemanticity of the
experts whose ablation changes some class's accuracy falls as ``N`` grows from 32 to 1,024, and
that entmax15 and the gate's BatchNorm give lower values than softmax and no normalisation.

This module tests that claim where it can be tested on a small CPU machine without downloads: a
deterministic generator of frozen "backbone features" with ImageNet's kind of class structure
([`make_features`][mumoe_tn.analysis.specialisation_study.make_features]: superclasses of related classes, several
modes per class, a
fixed random ReLU feature map), a CP μMoE as the final layer, ``N`` from 16 to 1,024, three gate settings
and several seeds. Every expert is switched off in turn with the exact linear identity the
library's ablation relies on
([`expert_ablation_effects`][mumoe_tn.analysis.specialisation_study.expert_ablation_effects]), evaluating
only the (sample, expert) pairs whose prediction a bound says could change.

``mumoe-tn specialisation`` ([`mumoe_tn.cli.specialisation_command`][mumoe_tn.cli.specialisation_command]) runs
it from the command line; the results and how they compare with the paper's are on the documentation's
"Expert specialisation" page.
"""

from __future__ import annotations

import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from mumoe_tn.analysis.polysemanticity import Polysemanticity, class_accuracies
from mumoe_tn.layers import MuMoE

__all__ = [
    "GATES",
    "ExperimentConfig",
    "Features",
    "aggregate",
    "expert_ablation_effects",
    "make_features",
    "measure_model",
    "plot_results",
    "run_experiment",
    "table",
    "to_markdown",
    "train_classifier",
]

#: The gate settings compared: the paper's (entmax15 + BatchNorm) and one ablation of each.
GATES: dict[str, tuple[str, str]] = {
    "entmax15+batchnorm": ("entmax15", "batch"),
    "softmax+batchnorm": ("softmax", "batch"),
    "entmax15+none": ("entmax15", "none"),
}


@dataclass(frozen=True)
class Features:
    """Standardised features and labels of the generated classification task.

    Attributes
    ----------
    train_x, test_x : torch.Tensor
        Features ``(samples, dim)``.
    train_y, test_y : torch.Tensor
        Class labels ``(samples,)``.
    n_classes : int
        Number of classes.
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    n_classes: int


@dataclass(frozen=True)
class ExperimentConfig:
    """Sizes of one experiment (the defaults are the full run; `quick` a seconds-long one).

    Attributes
    ----------
    expert_counts : tuple of int
        Numbers of experts ``N`` of the μMoE head.
    gates : tuple of str
        Keys of [`GATES`][mumoe_tn.analysis.specialisation_study].
    seeds : tuple of int
        Model seeds (initialisation and batch order); the data are the same for every seed.
    classes, superclasses, modes, latent, features : int
        Generator sizes (see [`make_features`][mumoe_tn.analysis.specialisation_study.make_features]).
    noise : float
        Within-mode standard deviation of the generator (sets how hard the task is).
    train_per_class, test_per_class : int
        Samples per class.
    rank : int
        CP rank of the head (fixed across ``N``, as the paper's ``CP-r512``).
    epochs, batch_size : int
        Training length and batch size (Adam).
    learning_rate : float
        Adam's learning rate.
    data_seed : int
        Seed of the generator.
    """

    expert_counts: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
    gates: tuple[str, ...] = tuple(GATES)
    seeds: tuple[int, ...] = (0, 1, 2)
    classes: int = 100
    superclasses: int = 20
    modes: int = 3
    latent: int = 16
    features: int = 64
    noise: float = 1.0
    train_per_class: int = 40
    test_per_class: int = 30
    rank: int = 64
    epochs: int = 15
    batch_size: int = 256
    learning_rate: float = 5e-3
    data_seed: int = 0

    @classmethod
    def quick(cls) -> ExperimentConfig:
        """A run of seconds (for tests): 20 classes, ``N`` in 1, 4, 16, two seeds, 3 epochs."""
        return cls(
            expert_counts=(1, 4, 16),
            seeds=(0, 1),
            classes=20,
            superclasses=5,
            train_per_class=20,
            test_per_class=10,
            rank=8,
            epochs=3,
            batch_size=100,
        )

    def __post_init__(self) -> None:
        for name in ("classes", "superclasses", "modes", "latent", "features", "rank", "epochs", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("train_per_class", "test_per_class"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.batch_size < 2:
            raise ValueError(f"batch_size must be at least 2 (BatchNorm gates need 2 samples), got {self.batch_size}")
        if self.classes < self.superclasses:
            raise ValueError(f"classes ({self.classes}) must be at least superclasses ({self.superclasses})")
        if not self.expert_counts or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.expert_counts
        ):
            raise ValueError(f"expert_counts must be positive integers, got {self.expert_counts!r}")
        if not self.seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in self.seeds):
            raise ValueError(f"seeds must be integers, got {self.seeds!r}")
        unknown = [g for g in self.gates if g not in GATES]
        if not self.gates or unknown:
            raise ValueError(f"gates must be among {list(GATES)}, got {list(self.gates)!r}")
        if not (math.isfinite(self.noise) and self.noise > 0):
            raise ValueError(f"noise must be a positive finite number, got {self.noise!r}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"learning_rate must be a positive finite number, got {self.learning_rate!r}")


def make_features(config: ExperimentConfig) -> Features:
    """Generate the task: ImageNet-like class structure seen through a frozen random network.

    ``superclasses`` centres are drawn in a ``latent``-dimensional space (standard deviation 3);
    each class belongs to superclass ``c mod superclasses`` and has ``modes`` modes drawn around
    its superclass centre (standard deviation 1), so related classes overlap and a class is not
    one blob (a linear probe cannot separate it cleanly, a gated mixture can). A sample is a
    random mode of its class plus isotropic noise (``noise``), mapped to ``features`` dimensions
    by a fixed random ReLU layer (the frozen "backbone") and standardised with the training
    statistics. Everything is drawn from one ``torch.Generator`` seeded with ``data_seed``.

    Parameters
    ----------
    config : ExperimentConfig
        Sizes and seed.

    Returns
    -------
    Features
    """
    generator = torch.Generator().manual_seed(config.data_seed)
    centres = 3.0 * torch.randn(config.superclasses, config.latent, generator=generator)
    parent = torch.arange(config.classes) % config.superclasses
    modes = centres[parent][:, None, :] + torch.randn(config.classes, config.modes, config.latent, generator=generator)
    backbone = torch.randn(config.latent, config.features, generator=generator) / math.sqrt(config.latent)

    def sample(per_class: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.arange(config.classes).repeat_interleave(per_class)
        mode = torch.randint(config.modes, (labels.numel(),), generator=generator)
        latent = modes[labels, mode] + config.noise * torch.randn(labels.numel(), config.latent, generator=generator)
        return torch.relu(latent @ backbone), labels

    train_x, train_y = sample(config.train_per_class)
    test_x, test_y = sample(config.test_per_class)
    mean, std = train_x.mean(0), train_x.std(0).clamp_min(1e-3)
    return Features((train_x - mean) / std, train_y, (test_x - mean) / std, test_y, config.classes)


def train_classifier(model: nn.Module, features: Features, config: ExperimentConfig, seed: int) -> None:
    """Train ``model`` on the training features with Adam and cross-entropy (in place)."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate)
    x, y = features.train_x, features.train_y
    model.train()
    for _ in range(config.epochs):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(order), config.batch_size):
            chosen = order[start : start + config.batch_size]
            if len(chosen) < 2:
                continue
            loss = F.cross_entropy(model(x[chosen]), y[chosen])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    model.eval()


@torch.no_grad()
def expert_ablation_effects(
    layer: MuMoE, inputs: torch.Tensor, labels: torch.Tensor, n_classes: int, *, pairs_per_step: int = 4096
) -> tuple[Polysemanticity, torch.Tensor]:
    """Switch every expert of a one-mode μMoE *classifier* off in turn; class accuracy changes.

    Gives what [`mumoe_tn.analysis.class_polysemanticity`][mumoe_tn.analysis.polysemanticity.class_polysemanticity]
    gives for a layer whose outputs are the logits, without its ``N`` counterfactual forward passes over all samples
    (``O(S·N²·R)`` work: minutes for ``N = 1,024``). The output is linear in the coefficients, so with expert
    ``n`` off sample ``s`` gets the logits ``l_s − a_{s,n} v_{s,n}`` with ``v_{s,n} = W_nᵀ [z_s; 1]``.
    The prediction can only change if ``2 a_{s,n} ‖v_{s,n}‖_∞`` reaches the margin between the top
    two logits of ``s``; ``‖v_{s,n}‖_∞ ≤ max_o ‖W_n[:, o]‖₂ · ‖[z_s; 1]‖₂`` bounds it, so only the
    pairs ``(s, n)`` that pass this test (with slack for rounding) are evaluated, from the
    materialised ``W`` (``N·(I+1)·O`` numbers). Every other pair keeps its prediction exactly. A
    sample whose only selected expert is ``n`` gets exactly zero logits, as in the layer.
    Computation runs in the layer's dtype.

    Parameters
    ----------
    layer : MuMoE
        A trained one-expert-mode layer whose outputs are the class logits (put in eval mode).
    inputs : torch.Tensor
        Test inputs ``(S, in_features)``.
    labels : torch.Tensor
        Integer labels ``(S,)``.
    n_classes : int
        Number of classes ``C``.
    pairs_per_step : int, optional
        Candidate (sample, expert) pairs evaluated together.

    Returns
    -------
    effects : Polysemanticity
        Per-expert class accuracies, ``d`` and ``p`` (as the paper defines it).
    coefficients : torch.Tensor
        The gate's coefficients on ``inputs``, ``(S, N)``.
    """
    if not isinstance(layer, MuMoE) or len(layer.expert_dims) != 1:
        raise TypeError("expert_ablation_effects needs a MuMoE layer with one expert mode")
    if labels.ndim != 1 or labels.shape[0] != inputs.shape[0]:
        raise ValueError(f"labels must have shape ({inputs.shape[0]},), got {tuple(labels.shape)}")
    layer.eval()
    logits = layer(inputs)
    coefficients = layer.last_coefficients[0].to(logits.dtype)
    z = layer.input_norm(inputs)
    if layer.bias:
        z = torch.cat([z, torch.ones(z.shape[0], 1, dtype=z.dtype, device=z.device)], dim=-1)
    weight = layer.experts.to_dense().to(logits.dtype)  # (N, I[+1], O)
    n_experts = weight.shape[0]
    predictions = logits.argmax(-1)
    correct = predictions == labels
    top2 = logits.topk(2, dim=-1).values if logits.shape[-1] > 1 else torch.cat([logits, logits - 1], dim=-1)
    margin = top2[:, 0] - top2[:, 1]
    bound = 2 * coefficients * weight.norm(dim=1).amax(-1) * z.norm(dim=-1, keepdim=True)
    scale = logits.abs().amax(-1, keepdim=True) + 1
    samples, experts = torch.nonzero(bound * (1 + 1e-5) + 1e-6 * scale >= margin[:, None], as_tuple=True)
    # change[n, c]: correct predictions of class c gained (+1) or lost (−1) with expert n off
    change = torch.zeros(n_experts, n_classes, dtype=torch.long, device=logits.device)
    for start in range(0, samples.numel(), pairs_per_step):
        s, n = samples[start : start + pairs_per_step], experts[start : start + pairs_per_step]
        outputs = torch.einsum("pi,pio->po", z[s], weight[n])
        ablated_logits = logits[s] - coefficients[s, n, None] * outputs
        # a sample whose only selected expert is n gets exactly zero logits (argmax: class 0),
        # not the rounding noise left by the subtraction
        alone = coefficients[s, n] == coefficients[s].sum(-1)
        ablated_logits = torch.where(alone[:, None], torch.zeros_like(ablated_logits), ablated_logits)
        now_correct = ablated_logits.argmax(-1) == labels[s]
        flips = now_correct.long() - correct[s].long()
        change.index_put_((n, labels[s]), flips, accumulate=True)
    support = torch.bincount(labels, minlength=n_classes).double().clamp_min(1)
    accuracy = class_accuracies(predictions, labels, n_classes)
    ablated = (accuracy * support + change.double()) / support
    differences = torch.where(accuracy > 0, (accuracy - ablated) / accuracy.clamp_min(1e-30), torch.zeros_like(ablated))
    one_hot = F.one_hot(differences.argmax(1), n_classes).double()
    effects = Polysemanticity(
        experts=[(n,) for n in range(n_experts)],
        accuracy=accuracy,
        ablated=ablated,
        differences=differences,
        polysemanticity=(differences - one_hot).norm(dim=1),
        changed=(change != 0).any(dim=1),
    )
    return effects, coefficients


def measure_model(layer: MuMoE, features: Features) -> dict:
    """Test accuracy, expert usage and polysemanticity of one trained head.

    Returns
    -------
    dict
        ``test_accuracy``; ``experts_used`` (non-zero coefficient on some test sample);
        ``experts_per_sample`` (mean count of non-zero coefficients of a test sample) and
        ``top_coefficient`` (mean largest coefficient of a test sample);
        ``experts_changing_a_class`` (the paper's footnote filter) and their
        ``mean_polysemanticity``; ``mean_polysemanticity_all`` (every expert; an expert that
        changes nothing has ``d = 0`` and ``p = 1``); for the filtered experts the mean largest
        single-class drop ``mean_max_drop`` (``max_c d_c``), the mean number of classes whose
        accuracy drops, and the largest-drop values themselves (``max_drops``).
    """
    effects, coefficients = expert_ablation_effects(layer, features.test_x, features.test_y, features.n_classes)
    changed = effects.changed
    any_changed = bool(changed.any())
    dropped = (effects.differences > 0).sum(1).double()
    max_drop = effects.differences.max(1).values
    counts = torch.bincount(features.test_y, minlength=features.n_classes).double()
    return {
        "test_accuracy": float((effects.accuracy * counts).sum() / counts.sum()),
        "experts_used": int((coefficients > 0).any(0).sum()),
        "experts_per_sample": float((coefficients > 0).sum(1).double().mean()),
        "top_coefficient": float(coefficients.max(1).values.double().mean()),
        "experts_changing_a_class": int(changed.sum()),
        "mean_polysemanticity": effects.mean if any_changed else None,
        "mean_polysemanticity_all": float(effects.polysemanticity.mean()),
        "mean_max_drop": float(max_drop[changed].mean()) if any_changed else None,
        "mean_classes_dropped": float(dropped[changed].mean()) if any_changed else None,
        "max_drops": [round(float(v), 4) for v in max_drop[changed]],
    }


def _linear_probe_accuracy(features: Features, config: ExperimentConfig, seed: int) -> float:
    torch.manual_seed(seed)
    probe = nn.Linear(features.train_x.shape[1], features.n_classes)
    train_classifier(probe, features, config, seed)
    with torch.no_grad():
        return float((probe(features.test_x).argmax(-1) == features.test_y).double().mean())


_SUMMARY = (
    "test_accuracy",
    "experts_used",
    "experts_per_sample",
    "top_coefficient",
    "experts_changing_a_class",
    "mean_polysemanticity",
    "mean_polysemanticity_all",
    "mean_max_drop",
    "mean_classes_dropped",
)


def aggregate(runs: Sequence[dict]) -> list[dict]:
    """Mean, standard deviation, minimum and maximum over seeds per (gate, N).

    Parameters
    ----------
    runs : Sequence of dict
        One dict per (gate, experts, seed) as made by
        [`run_experiment`][mumoe_tn.analysis.specialisation_study.run_experiment].

    Returns
    -------
    list of dict
        One row per (gate, experts) with ``seeds`` and, for every summarised metric ``m``,
        ``m`` (mean), ``m_std``, ``m_min``, ``m_max`` over the seeds where ``m`` is defined (None where it never is).
    """
    rows: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        rows.setdefault((r["gate"], r["experts"]), []).append(r)
    table = []
    for (gate, experts), group in rows.items():
        row: dict = {"gate": gate, "experts": experts, "seeds": len(group)}
        for metric in _SUMMARY:
            values = torch.tensor([g[metric] for g in group if g[metric] is not None], dtype=torch.float64)
            if values.numel() == 0:
                row.update({metric: None, f"{metric}_std": None, f"{metric}_min": None, f"{metric}_max": None})
                continue
            std = float(values.std(unbiased=False)) if values.numel() > 1 else 0.0
            row.update(
                {
                    metric: float(values.mean()),
                    f"{metric}_std": std,
                    f"{metric}_min": float(values.min()),
                    f"{metric}_max": float(values.max()),
                }
            )
        table.append(row)
    return table


def run_experiment(config: ExperimentConfig, *, progress: bool = True) -> dict:
    """Train and measure one head per (gate, N, seed); returns the JSON-ready result.

    Parameters
    ----------
    config : ExperimentConfig
        The sizes.
    progress : bool, optional
        Show a tqdm progress bar on stderr.

    Returns
    -------
    dict
        ``config``, ``linear_probe_accuracy`` (per seed), ``runs`` (per model, see
        [`measure_model`][mumoe_tn.analysis.specialisation_study.measure_model]), ``table``
        ([`aggregate`][mumoe_tn.analysis.specialisation_study.aggregate]), ``seconds`` and ``machine``.
    """
    from tqdm import tqdm

    start = time.perf_counter()
    features = make_features(config)
    jobs = [(g, n, s) for g in config.gates for n in config.expert_counts for s in config.seeds]
    runs = []
    bar = tqdm(jobs, desc="specialisation", disable=not progress, file=sys.stderr)
    for gate, n, seed in bar:
        bar.set_postfix_str(f"{gate} N={n} seed={seed}", refresh=False)  # shown with the count, never before it
        activation, norm = GATES[gate]
        torch.manual_seed(seed)
        layer = MuMoE(
            features.train_x.shape[1], features.n_classes, n, "cp", config.rank, activation=activation, gate_norm=norm
        )
        train_classifier(layer, features, config, seed)
        runs.append({"gate": gate, "experts": n, "seed": seed, **measure_model(layer, features)})
    probe = [_linear_probe_accuracy(features, config, seed) for seed in config.seeds]
    return {
        "config": asdict(config),
        "linear_probe_accuracy": probe,
        "runs": runs,
        "table": aggregate(runs),
        "seconds": round(time.perf_counter() - start, 1),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
    }


def _spread(row: dict, metric: str, digits: int) -> str:
    if row[metric] is None:
        return "–"
    return f"{row[metric]:.{digits}f} ± {row[f'{metric}_std']:.{digits}f}"


_COLUMNS = (
    ("gate", "gate", None),
    ("experts", "N", None),
    ("test_accuracy", "test acc.", 3),
    ("experts_used", "experts used", 1),
    ("experts_per_sample", "experts per sample", 1),
    ("top_coefficient", "top coefficient", 2),
    ("experts_changing_a_class", "experts changing a class", 1),
    ("mean_polysemanticity", "mean p (changing experts)", 3),
    ("mean_polysemanticity_all", "mean p (all experts)", 3),
    ("mean_max_drop", "mean max_c d", 3),
    ("mean_classes_dropped", "classes dropped per expert", 1),
)


def table(result: dict) -> tuple[list[str], list[list[str]]]:
    """The result's table: the column titles, and one row of cells per (gate, N) (mean ± standard deviation over seeds).

    Parameters
    ----------
    result : dict
        As returned by [`run_experiment`][mumoe_tn.analysis.specialisation_study.run_experiment].

    Returns
    -------
    headers : list of str
    rows : list of list of str
    """
    headers = [title for _, title, _ in _COLUMNS]
    rows = [
        [str(row[key]) if digits is None else _spread(row, key, digits) for key, _, digits in _COLUMNS]
        for row in result["table"]
    ]
    return headers, rows


def to_markdown(result: dict) -> str:
    """The result's table as Markdown (mean ± standard deviation over seeds)."""
    headers, rows = table(result)
    lines = ["| " + " | ".join(headers) + " |", "|---|" + "---:|" * (len(headers) - 1)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def plot_results(result: dict, path: str | Path) -> Path:
    """Save the figure: polysemanticity, experts that matter, and the distribution of ``max_c d``.

    Parameters
    ----------
    result : dict
        As returned by [`run_experiment`][mumoe_tn.analysis.specialisation_study.run_experiment].
    path : str or Path
        PNG file.

    Returns
    -------
    Path
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    for gate in result["config"]["gates"]:
        rows = [r for r in result["table"] if r["gate"] == gate]
        n = [r["experts"] for r in rows]
        for ax, metric, style in (
            (axes[0], "mean_polysemanticity", "-"),
            (axes[1], "mean_polysemanticity_all", "-"),
            (axes[2], "experts_changing_a_class", "-"),
        ):
            mean = [math.nan if r[metric] is None else r[metric] for r in rows]
            low = [math.nan if r[metric] is None else r[f"{metric}_min"] for r in rows]
            high = [math.nan if r[metric] is None else r[f"{metric}_max"] for r in rows]
            (line,) = ax.plot(n, mean, style, marker="o", label=gate)
            ax.fill_between(n, low, high, color=line.get_color(), alpha=0.2)
    axes[0].set(ylabel="mean p, experts changing a class (↓)", title="footnote filter (paper's metric)")
    axes[1].set(ylabel="mean p, all experts (↓)", title="no filter")
    axes[2].set(ylabel="experts whose ablation changes a class", title="how many experts matter")
    counts = result["config"]["expert_counts"]
    axes[2].plot(counts, counts, ":", color="grey", label="N (all experts)")
    axes[2].set_yscale("log", base=2)
    main_gate = result["config"]["gates"][0]
    drops = [
        [v for r in result["runs"] if r["gate"] == main_gate and r["experts"] == n for v in r["max_drops"]]
        for n in counts
    ]
    axes[3].boxplot([d if d else [math.nan] for d in drops], tick_labels=[str(n) for n in counts], showfliers=True)
    axes[3].set(
        xlabel="number of experts N",
        ylabel="max_c d (largest class accuracy drop)",
        title=f"{main_gate}: d of changing experts",
    )
    for ax in axes[:3]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("number of experts N")
        ax.grid(True, alpha=0.3)
    axes[3].grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
