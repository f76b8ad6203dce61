"""Per-thread records: what an eager call records replaces what a compiled call kept."""

from mumoe_tn.gates.records import PerThreadRecords


def test_an_eager_record_replaces_the_compiled_one_and_keeps_every_name():
    records = PerThreadRecords()
    records._compiled_losses = {"balance": 1.0}  # as a compiled training call leaves it
    records._remember_eager(("losses", "coefficients"), ({"balance": 2.0}, (3.0,)))
    assert records._recall("losses") == {"balance": 2.0}
    assert records._recall("coefficients") == (3.0,)
    assert "_compiled_losses" not in records.__dict__
