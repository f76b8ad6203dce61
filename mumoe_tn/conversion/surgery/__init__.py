"""Model surgery: which modules of a model are replaced, and the μMoE blocks that replace them.

- [`adapters`][mumoe_tn.conversion.surgery.adapters]: how a linear layer of any library is read
  (its weight, bias and layout), and the registry of readers.
- [`block_kinds`][mumoe_tn.conversion.surgery.block_kinds]: the kinds of replaced module (a linear
  layer, a plain, gated or split MLP block), registered objects that tools ask.
- [`blocks`][mumoe_tn.conversion.surgery.blocks]: which modules are MLP blocks, and their parts.
- [`building`][mumoe_tn.conversion.surgery.building]: the modules chosen, the blocks built for
  them, and their installation in the model (and removal).

Surgery imports no other part of ``mumoe_tn.conversion``: the persistence replays a record with
it, and [`convert`][mumoe_tn.conversion.convert] joins it to the fitting and the record.
"""
