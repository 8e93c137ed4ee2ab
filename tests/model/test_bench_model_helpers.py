"""benchmarks/bench_model.py's helpers that read profiles: which launches a way's switch changed."""

from tests.support.benchmarks import load_benchmark

bench_model = load_benchmark("bench_model")


def test_kernel_changes_lists_launches_taken_away_and_added():
    before = [{"name": "linears", "calls_per_step": 12.0}, {"name": "gatherTopK", "calls_per_step": 1.0},
              {"name": "memset", "calls_per_step": 1.0}]
    after = [{"name": "linears", "calls_per_step": 11.0}, {"name": "_router_topk_kernel", "calls_per_step": 1.0},
             {"name": "_router_partial_kernel", "calls_per_step": 1.0}]
    assert bench_model.kernel_changes(before, after) == [
        "-1.0 linears", "-1.0 gatherTopK", "-1.0 memset", "+1.0 _router_topk_kernel", "+1.0 _router_partial_kernel"]
    assert bench_model.kernel_changes(after, after) == []
