"""Distillation: MLP blocks of a trained model distilled into sparse replacements, spliced in and measured.

- [`streaming`][mumoe_tn.distillation.streaming]: which blocks, their input/output activations
  streamed from a model through a bounded buffer.
- [`replacements`][mumoe_tn.distillation.replacements] and
  [`transcoders`][mumoe_tn.distillation.transcoders]: what a block is distilled into — μMoE blocks
  of any registered or custom network (a Mixture of Decoders for ``mxd``), TopK and skip
  transcoders — all at one parameter budget.
- [`training`][mumoe_tn.distillation.training]: the training loop over streamed activations
  (resumable, seeded, a named recipe), its options in one object
  ([`distill_options`][mumoe_tn.distillation.distill_options]);
  [`splicing`][mumoe_tn.distillation.splicing]: replacements put in the model;
  [`resume_checks`][mumoe_tn.distillation.resume_checks]: a resume file read as data.
- [`process_shares`][mumoe_tn.distillation.process_shares]: distillation across the processes of a
  ``torchrun`` job, each training its share of the replacements.
- [`losses`][mumoe_tn.distillation.losses]: the registered loss terms (normalised MSE, FVU, L1,
  the routing's load balance, auxiliary-k on dead units); [`codes`][mumoe_tn.distillation.codes]:
  a replacement's sparse code.
- [`metrics`][mumoe_tn.distillation.metrics]: the registered block-level metrics (L0, normalised
  MSE, explained variance, dead units).
- [`faithfulness`][mumoe_tn.distillation.faithfulness]: L0, normalised MSE and next-token loss
  with the replacements spliced in, against the clean and zero-ablated model.
- [`frontier`][mumoe_tn.distillation.frontier]: the sparsity–accuracy table and its plot.
- [`paired`][mumoe_tn.distillation.paired]: two methods of a block compared sequence by sequence
  (a paired bootstrap over the held-out sequences, for one seed or many).
- [`methods`][mumoe_tn.distillation.methods]: the registered distillation methods, their text
  forms parsed once into structured specs.
- [`study`][mumoe_tn.distillation.study]: a whole frontier run, as ``mumoe-tn distill`` runs it.
- [`run_files`][mumoe_tn.distillation.run_files]: a run saved to a directory that describes how to
  rebuild its replacements ([`replacement_specs`][mumoe_tn.distillation.replacement_specs]), loaded
  back as data; [`replacement_files`][mumoe_tn.distillation.replacement_files]: replacements in one
  safetensors file, loaded all or nothing.
"""

from mumoe_tn.distillation.distill_options import DistillOptions
from mumoe_tn.distillation.faithfulness import evaluate_replacements
from mumoe_tn.distillation.frontier import FrontierRow, FrontierTable, ce_loss_score, plot_frontier
from mumoe_tn.distillation.losses import AuxK, GateBalance, Loss, available_losses, get_loss, register_loss
from mumoe_tn.distillation.metrics import Metric, available_metrics, register_metric
from mumoe_tn.distillation.paired import PairedDifference, paired_difference
from mumoe_tn.distillation.replacements import mumoe_factory, transcoder_factory
from mumoe_tn.distillation.splicing import splice, spliced
from mumoe_tn.distillation.streaming import BlockInfo, select_blocks
from mumoe_tn.distillation.training import RECIPES, Distillation, distill, normalised_mse
from mumoe_tn.distillation.transcoders import Transcoder

__all__ = [
    "RECIPES",
    "AuxK",
    "BlockInfo",
    "DistillOptions",
    "Distillation",
    "FrontierRow",
    "FrontierTable",
    "GateBalance",
    "Loss",
    "Metric",
    "PairedDifference",
    "Transcoder",
    "available_losses",
    "available_metrics",
    "ce_loss_score",
    "distill",
    "evaluate_replacements",
    "get_loss",
    "mumoe_factory",
    "normalised_mse",
    "paired_difference",
    "plot_frontier",
    "register_loss",
    "register_metric",
    "select_blocks",
    "splice",
    "spliced",
    "transcoder_factory",
]
