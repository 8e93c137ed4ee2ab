"""The weight floors' bandwidth: the benchmarking GPU's own peak, found by its name."""

import pytest

from dsv4_compile.testing.bench import DEFAULT_HBM_TBPS, peak_hbm_tbps


@pytest.mark.parametrize("name, tbps", [
    ("NVIDIA H200", 4.8),
    ("NVIDIA H100 80GB HBM3", 3.35),
    ("NVIDIA H100 NVL", 3.9),
    ("NVIDIA H100 PCIe", 2.0),
])
def test_known_gpus_get_their_peak(name, tbps):
    assert peak_hbm_tbps(name) == tbps


@pytest.mark.parametrize("name", [None, "NVIDIA A100-SXM4-80GB"])
def test_no_or_an_unknown_gpu_gets_the_h200_figure(name):
    assert peak_hbm_tbps(name) == DEFAULT_HBM_TBPS == 4.8
