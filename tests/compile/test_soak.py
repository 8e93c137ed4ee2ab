"""A short CPU run of benchmarks/soak.py through compile_step (eager backend, to stay fast): the
random serving loop runs, its sampled per-layer and cache checks hold, and the JSON report has
every figure."""

import json

from tests.support.benchmarks import load_benchmark
from tests.support.oracle_asserts import CACHE_MAX_RTOL, CACHE_RMS_RTOL, LAYER_RTOL


def test_soak_smoke(tmp_path):
    out = tmp_path / "soak.json"
    args = ["--steps", "12", "--check-every", "3", "--max-prompt", "80", "--max-new", "20", "--chunk", "48",
            "--max-requests", "3", "--max-seq-len", "256", "--memory-every", "0", "--compile",
            "--backend", "eager", "--json", str(out)]
    assert load_benchmark("soak").main(args) == 0
    report = json.loads(out.read_text())
    assert report["steps"] == 12 and sum(report["steps_by_mode"].values()) == 12
    assert {"extend", "decode", "target_verify"} <= {m for m, n in report["steps_by_mode"].items() if n}
    assert report["checks"] >= 2 and report["tokens"] > 0
    assert max(report["worst_layer_error"]) <= LAYER_RTOL
    for kind, err in report["worst_cache_error"].items():
        assert err <= (CACHE_RMS_RTOL if kind.endswith("_rms") else CACHE_MAX_RTOL), kind
    assert len(report["memory"]) >= 12 and "rss" in report["memory"][-1][1]
