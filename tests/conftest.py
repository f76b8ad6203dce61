"""Shared test configuration: hypothesis profiles (``HYPOTHESIS_PROFILE=ci|dev|mutation|thorough``)."""

import os

import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# mutation runs (tests/README.md): every test runs once per mutant, so fewer examples each
settings.register_profile(
    "mutation", max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("thorough", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(min(2, torch.get_num_threads()))

# The fixtures' writer scripts import the paths of the version that wrote them (fixtures/v0_3/
# runs with 0.3 on the path): they are records, never collected.
collect_ignore_glob = ["fixtures/*/*.py"]
