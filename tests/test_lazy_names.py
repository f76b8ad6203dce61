"""The lazy names of the packages: served from their modules, any other name refused as Python would."""

import importlib

import pytest

import mumoe_tn
from mumoe_tn.lazy_names import lazy_getattr


@pytest.mark.parametrize(
    ("package", "name", "home"),
    [
        ("mumoe_tn", "MuMoE", "mumoe_tn.layers"),
        ("mumoe_tn.gates", "entmax15", "mumoe_tn.gates.activation_maps"),
        ("mumoe_tn.contractions", "dense_forward", "mumoe_tn.contractions.dense"),
        ("mumoe_tn.gates.kernels", "top_k_softmax", "mumoe_tn.gates.triton_kernels"),
    ],
)
def test_a_lazy_name_is_the_object_of_its_module(package, name, home):
    assert getattr(importlib.import_module(package), name) is getattr(importlib.import_module(home), name)


@pytest.mark.parametrize("package", ["mumoe_tn", "mumoe_tn.gates", "mumoe_tn.contractions", "mumoe_tn.gates.kernels"])
def test_an_unknown_name_is_an_attribute_error_naming_the_package(package):
    module = importlib.import_module(package)
    with pytest.raises(AttributeError, match=rf"^module '{package}' has no attribute 'no_such_name'$"):
        module.no_such_name  # noqa: B018
    assert not hasattr(module, "no_such_name")


def test_the_getattr_reads_the_table_it_was_given():
    homes = {"sqrt": "math"}
    served = lazy_getattr("example", homes)
    assert served("sqrt")(9.0) == 3.0
    with pytest.raises(AttributeError, match=r"^module 'example' has no attribute 'floor'$"):
        served("floor")
    assert mumoe_tn.__getattr__("ExpertGate").__name__ == "ExpertGate"
