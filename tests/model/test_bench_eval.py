"""A short CPU run of benchmarks/bench_eval.py: every way runs both loops on the same sequences and
prompts, the compiled way compiles nothing after its warm-up, and the backend's log-probs and
greedy tokens agree with transformers eager."""

import json

from tests.support.benchmarks import load_benchmark

WAYS = ("hf_eager", "hf_batched", "backend_eager", "compiled")


def test_bench_eval_smoke(tmp_path, capsys):
    out = tmp_path / "bench_eval.json"
    args = ["--device", "cpu", "--limit", "3", "--gen-prompts", "2", "--max-new-tokens", "3", "--batch", "2",
            "--out", str(out)]
    assert load_benchmark("bench_eval").main(args) == 0
    assert "| score | compiled |" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["commit"] and tuple(report["ways"]) == WAYS
    for way, figures in report["ways"].items():
        assert figures["score"]["sequences"] == 3 and figures["generate"]["tokens"] == 2 * 3, way
        assert figures["score"]["tokens"] == report["ways"]["hf_eager"]["score"]["tokens"], way
        assert figures["score"]["tokens_per_s"] > 0 and figures["generate"]["tokens_per_s"] > 0, way
    compiled = report["ways"]["compiled"]
    assert compiled["recompiles_after_warmup"] == 0 and compiled["warmup_s"] >= compiled["compile_s"] > 0
    for way in ("backend_eager", "compiled"):
        check = report["ways"][way]
        assert check["score"]["vs_hf_eager"]["mean_abs_logprob_diff"] < 0.05, way
        assert check["generate"]["vs_hf_eager"]["token_agreement"] >= 0.5, way
    assert set(report["compiled_vs"]["score"]) == {f"compiled_vs_{w}" for w in WAYS[:3]}
