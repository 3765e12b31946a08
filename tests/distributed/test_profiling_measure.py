"""Measured peak memory per rank of real pipelined steps against the analytic model.

The standard check of :mod:`specrl.profiling.measure`: specrl's pipelined policy step with the
draft co-trained on the last stage (4 microbatches of one 512-token sequence, K = 3, fp32, AdamW)
on the small model, for cp ∈ {1, 2, 4} × pp ∈ {1, 2} in spawned gloo worlds.  Every pipeline
rank's peak — from the allocator's event stream — must lie within ±20 % of the prediction, and
the measured peaks must fall as cp grows.  Step times are measured elsewhere, never asserted.
"""

from __future__ import annotations

import pytest

from specrl.models.config import ModelConfig
from specrl.profiling.hardware import measure_cpu
from specrl.profiling.layouts import Layout
from specrl.profiling.measure import GRID, SMALL_MODEL, compare, small_workload

pytestmark = pytest.mark.distributed

TOLERANCE = 0.20


def test_measured_peak_memory_per_rank_matches_the_model():
    rows = compare(ModelConfig(**SMALL_MODEL), GRID, small_workload(512), measure_cpu(), timed=0)
    report = [
        f"{c.estimate.layout} pp rank {r}: measured {m / 2**20:.2f} MiB, predicted "
        f"{p / 2**20:.2f} MiB ({m / p:.2f})"
        for c in rows
        for r, (m, p) in enumerate(zip(c.measured_peak, c.predicted_peak, strict=True))
    ]
    ratios = [ratio for c in rows for ratio in c.ratios]
    assert len(ratios) == 9, report  # three pp = 1 layouts, three pp = 2 layouts of two ranks
    assert all(1 - TOLERANCE <= x <= 1 + TOLERANCE for x in ratios), "\n".join(report)

    peaks = {c.estimate.layout: c.measured_peak for c in rows}
    for pp in (1, 2):
        for r in range(pp):
            by_cp = [peaks[Layout(1, cp, pp)][r] for cp in (1, 2, 4)]
            assert by_cp[0] > by_cp[1] > by_cp[2], (pp, r, by_cp)
