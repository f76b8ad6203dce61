"""The allowed values of the gate options that the gate descriptors and the gate modules share (torch-free)."""

__all__ = ["GATE_INITS", "TOKEN_MIXING_NORMS"]

#: Initialisations of the gate projections: nn.Linear's default, or all zeros (uniform start).
GATE_INITS = ("default", "zeros")

#: Logit norms whose training-mode output for one token depends on the other tokens of the batch
#: (batch statistics). Add the name of a norm you register in [`GATE_NORMS`][mumoe_tn.gates.modules] if it does.
TOKEN_MIXING_NORMS = {"batch"}
