"""benchmarks/bench_runner_host.py runs on the CPU and writes its figures (a smoke check)."""

import json

from tests.support.benchmarks import load_benchmark

bench_runner_host = load_benchmark("bench_runner_host")


def test_cpu_run_writes_every_batch(tmp_path):
    out = tmp_path / "runner_host.json"
    bench_runner_host.main(["--device", "cpu", "--batch", "1", "3", "--steps", "4", "--repeats", "1",
                            "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and [r["batch"] for r in report["results"]] == [1, 3]
    assert all(r["build_step_us"] > 0 and r["generate_us"] > 0 and r["generate_serial_us"] > 0
               for r in report["results"])
