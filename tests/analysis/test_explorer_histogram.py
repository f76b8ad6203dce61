"""The explorer's coefficient histogram covers every coefficient, a ReLU gate's unbounded ones too."""

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from mumoe_tn.analysis.explorer.collect import ModeRecord


@given(
    scales=st.lists(st.sampled_from([0.5, 1.0, 3.0, 4.4, 17.0]), min_size=1, max_size=4),
    bins=st.integers(2, 9),
    seed=st.integers(0, 99),
)
def test_histogram_counts_equal_numpy_over_the_final_range(scales, bins, seed):
    generator = torch.Generator().manual_seed(seed)
    record = ModeRecord(torch.zeros(3, bins, dtype=torch.long), None)
    batches = [torch.rand(5, 3, generator=generator, dtype=torch.float64) * scale for scale in scales]
    for batch in batches:
        record.add(batch, None, threshold=0.05)
    values = torch.cat(batches).numpy()
    largest = values.max()
    assert record.largest == largest
    assert record.upper == (1.0 if largest <= 1 else 2.0 ** np.ceil(np.log2(largest)))
    for expert in range(3):
        column = values[:, expert]
        expected, _ = np.histogram(column[column >= 0.05], bins=bins, range=(0.0, record.upper))
        assert record.histogram[expert].tolist() == expected.tolist()


def test_a_relu_gate_s_coefficients_spread_over_the_bins():
    record = ModeRecord(torch.zeros(1, 24, dtype=torch.long), None)
    record.add(torch.linspace(0.1, 4.4, 100).reshape(100, 1), None, threshold=0.0)
    assert record.upper == 8.0
    assert int(record.histogram[0, -1]) == 0  # nothing piled into a "≥ 1" bin
    assert int((record.histogram[0] > 0).sum()) >= 12
