"""benchmarks/bench_deploy.py refuses sizes its cache cannot hold before it builds a package (a
build takes minutes)."""

import pytest

from tests.support.benchmarks import load_benchmark

bench_deploy = load_benchmark("bench_deploy")


def test_defaults_fit():
    bench_deploy.check_args(bench_deploy.parse_args([]))


@pytest.mark.parametrize("argv, named", [
    (["--batches", "1,8", "--max-requests", "4"], "--batches"),
    (["--context", "1000", "--iters", "30", "--max-seq-len", "1024"], "--max-seq-len"),
    (["--prefill", "2048", "--max-seq-len", "1024"], "--prefill"),
])
def test_refused(argv, named):
    with pytest.raises(SystemExit, match=named):
        bench_deploy.check_args(bench_deploy.parse_args(argv))
