"""Persistence: a conversion as plain data, saved with the weights and read back as data.

- [`record`][mumoe_tn.conversion.persistence.record]: the conversion record, every field checked
  against its rule; [`record_checks`][mumoe_tn.conversion.persistence.record_checks]: its checks
  against a model and a checkpoint's shapes.
- [`replay`][mumoe_tn.conversion.persistence.replay]: a record written for a model and replayed
  on a fresh copy of the original.
- [`checkpoints`][mumoe_tn.conversion.persistence.checkpoints]: ``save_converted`` and
  ``load_converted``; [`quantizer`][mumoe_tn.conversion.persistence.quantizer]: stock
  ``from_pretrained`` through transformers' quantizer hook.
- [`files`][mumoe_tn.conversion.persistence.files], [`storage`][mumoe_tn.conversion.persistence.storage]
  and [`config_checks`][mumoe_tn.conversion.persistence.config_checks]: a checkpoint's files,
  tensors and ``config.json`` read as data.
- [`bounds`][mumoe_tn.conversion.persistence.bounds]: every limit and allow-list those checks hold
  a file to, in one place.

Persistence imports the [surgery][mumoe_tn.conversion.surgery] (a replayed record builds its
blocks there) and never the [fitting][mumoe_tn.conversion.fitting].
"""
