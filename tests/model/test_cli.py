"""``python -m dsv4_compile``: the evaluation of a model on the compiled backend (built-in model and
corpus, a saved checkpoint, a JSONL corpus), its summary and JSON, and bad input ending in one
error line with exit status 2 before any model is built."""

import json
import math
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig

import dsv4_compile.__main__ as cli
from dsv4_compile.evaluate.inputs import BUILTIN_LENGTHS, builtin_config, builtin_corpus
from tests.support.hf_model import tiny_hf_config

ERROR = "python -m dsv4_compile: error: "


def _one_error_line(err: str, message: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(ERROR) and message in lines[0], lines[0]


def _jsonl(path, *records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    """A folder of bad inputs: checkpoint directories of another model type, of a DeepSeek V4
    config the backend does not support, of a config without weights or with corrupt ones, and
    JSONL files."""
    root = tmp_path_factory.mktemp("bad_inputs")
    LlamaConfig().save_pretrained(root / "llama")
    tiny_hf_config(head_dim=256).save_pretrained(root / "head_dim")
    tiny_hf_config().save_pretrained(root / "no_weights")
    tiny_hf_config().save_pretrained(root / "corrupt_weights")
    (root / "corrupt_weights" / "model.safetensors").write_bytes(b"\xff" * 64)
    for name, records in {"long": [{"tokens": [1] * 300}], "bad": [{"tokens": [1, 2]}, "{tokens: [1]"],
                          "keys": [{"ids": [1]}], "floats": [{"tokens": [1.5]}], "vocab": [{"tokens": [1, 512]}],
                          "empty": [{"tokens": []}], "text": [{"text": "hi"}]}.items():
        _jsonl(root / f"{name}.jsonl", *records)
    return root


# case: (arguments, with {dir} the bad_inputs folder and {tiny} the tiny checkpoint; the message)
BAD = {
    "missing model directory": (["--model", "{dir}/absent"], "{dir}/absent: no such directory"),
    "not DeepSeek V4": (["--model", "{dir}/llama"], "describes a 'llama' model, not DeepSeek V4"),
    "unsupported config": (["--model", "{dir}/head_dim"], "DeepseekV4Config.head_dim=256"),
    "no weights": (["--model", "{dir}/no_weights"], "no *.safetensors weights"),
    "longer than max-seq-len": (["--data", "{dir}/long.jsonl", "--max-seq-len", "256"],
                                "long.jsonl line 1: 300 tokens is longer than --max-seq-len 256"),
    "prompt and new tokens too long": (["--data", "{dir}/long.jsonl", "--max-seq-len", "256", "--task", "generate"],
                                       "300 tokens + 16 new tokens is longer"),
    "max-seq-len not a page multiple": (["--max-seq-len", "300"], "must be a multiple of 256"),
    "malformed JSON line": (["--data", "{dir}/bad.jsonl"], "bad.jsonl line 2: not valid JSON"),
    "neither tokens nor text": (["--data", "{dir}/keys.jsonl"], 'keys.jsonl line 1: expected an object with "tokens"'),
    "tokens not integers": (["--data", "{dir}/floats.jsonl"], '"tokens" must be a list of integer token ids'),
    "token outside the vocabulary": (["--data", "{dir}/vocab.jsonl"],
                                     "token id 512 is outside the model's vocabulary [0, 512)"),
    "empty sequence": (["--data", "{dir}/empty.jsonl"], "empty.jsonl line 1: no tokens"),
    "text without a tokenizer": (["--data", "{dir}/text.jsonl"], "needs the checkpoint's tokenizer"),
    "checkpoint without a tokenizer": (["--model", "{tiny}", "--data", "{dir}/text.jsonl"],
                                       "no tokenizer for the texts of --data"),
    "missing data file": (["--data", "{dir}/absent.jsonl"], "{dir}/absent.jsonl: no such file"),
    "device name": (["--device", "gpu0"], "--device 'gpu0' is not a device name"),
    "device type": (["--device", "mps"], "only cpu and cuda"),
    "device index": (["--device", "cuda:7"], "--device 'cuda:7'"),
    "json directory": (["--json", "{dir}/absent/out.json"], "--json {dir}/absent/out.json: no directory"),
    "json is a directory": (["--json", "{dir}"], "--json {dir}: cannot write a file there"),
    "seed past int64": (["--seed", str(2**70)], f"--seed {2**70}: must lie in [0, 2**63)"),
    "max-seq-len past the positions": (["--max-seq-len", str(2**40)], "the model's max_position_embeddings is 4096"),
    "corrupt weights": (["--model", "{dir}/corrupt_weights"], "--model {dir}/corrupt_weights: cannot read its weights"),
    "task": (["--task", "translate"], "invalid choice: 'translate'"),
    "batch": (["--batch", "0"], "'0' is not a positive integer"),
}
# under torchrun (its environment, for make_plan only)
BAD_UNDER_TORCHRUN = {
    "device index": (["--device", "cuda:1"], "under torchrun each rank runs on cuda:LOCAL_RANK"),
    "compare-eager": (["--compare-eager"], "--compare-eager: transformers eager needs the whole model"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_ends_in_one_error_line(case, bad_inputs, tiny_hf_dir, capsys):
    args, message = BAD[case]
    assert cli.main([a.format(dir=bad_inputs, tiny=tiny_hf_dir) for a in args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    _one_error_line(err, message.format(dir=bad_inputs, tiny=tiny_hf_dir))


@pytest.mark.parametrize("case", list(BAD_UNDER_TORCHRUN))
def test_bad_input_under_torchrun(case, monkeypatch):
    args, message = BAD_UNDER_TORCHRUN[case]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name, value in (("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("RANK", "1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(cli.InputError, match=message):
        cli.make_plan(cli.parse_args(args))


def test_a_process_count_the_heads_do_not_split_over_is_refused(monkeypatch):
    for name, value in (("WORLD_SIZE", "3"), ("LOCAL_RANK", "0"), ("RANK", "0")):
        monkeypatch.setenv(name, value)
    with pytest.raises(cli.InputError, match="3 processes: .*num_attention_heads=.*tensor-parallel size 3"):
        cli.make_plan(cli.parse_args(["--device", "cpu"]))


def test_under_torchrun_each_rank_runs_on_its_own_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cli.check_device("cuda", local_rank=1) == cli.check_device(None, local_rank=1) == torch.device("cuda", 1)
    assert cli.check_device("cpu", local_rank=1) == torch.device("cpu")


def test_bad_input_from_the_command_has_no_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "dsv4_compile", "--model", str(tmp_path / "absent")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    _one_error_line(done.stderr, f"--model {tmp_path / 'absent'}: no such directory")


def test_builtin_corpus_spreads_lengths_past_the_index_topk():
    """The built-in corpus is the same for a seed; some sequences hold more c4 entries than the
    built-in model's index_topk and several c128 entries."""
    config = builtin_config()
    corpus = builtin_corpus(config.vocab_size, seed=0)
    assert corpus.sequences == builtin_corpus(config.vocab_size, seed=0).sequences
    lengths = [len(s) for s in corpus.sequences]
    assert len(lengths) >= 200 and (min(lengths), max(lengths)) == BUILTIN_LENGTHS
    assert sum(n // 4 > config.index_topk for n in lengths) >= 5 and sum(n // 128 >= 2 for n in lengths) >= 5
    assert set(config.layer_types) == {"sliding_attention", "compressed_sparse_attention",
                                       "heavily_compressed_attention"}
    assert set(config.mlp_layer_types) == {"hash_moe", "moe"} and config.hc_mult > 1


def test_default_run_compiles_once_and_reports(tmp_path, capsys):
    """The built-in model and corpus (the first sequences), compiled: summary rows, JSON, no frame
    compiled after warm-up, agreement with transformers eager."""
    out_json = tmp_path / "results.json"
    assert cli.main(["--limit", "3", "--batch", "2", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for row in ("model", "device", "step", "sequences", "tokens/s", "warm-up", "recompiles after warm-up",
                "perplexity", "mean |Δ log-prob|", "greedy agreement"):
        assert any(line.strip().startswith(row) for line in out.splitlines()), (row, out)
    results = json.loads(out_json.read_text())
    lengths = [len(s) for s in builtin_corpus(512, seed=0).sequences[:3]]
    assert results["task"] == "perplexity" and results["device"] == "cpu" and "eager backend" in results["step"]
    assert results["sequences"] == 3 and results["tokens"] == sum(lengths)
    assert results["scored_tokens"] == sum(lengths) - 3 and results["recompiles_after_warmup"] == 0
    assert results["tokens_per_s"] > 0 and results["warmup_s"] >= results["compile_s"] > 0
    assert 1 < results["perplexity"] < 10 * 512
    eager = results["eager"]
    assert eager["sequences"] == 3 and eager["tokens"] == results["scored_tokens"]
    assert eager["mean_abs_logprob_diff"] < 0.05 and eager["greedy_agreement"] > 0.7


def test_checkpoint_and_jsonl_tokens_generate(tmp_path, tiny_hf_dir, capsys):
    """``--model`` (the saved tiny checkpoint), ``--data`` with token ids, greedy generation, eager
    step, every sequence compared with transformers eager."""
    data = _jsonl(tmp_path / "prompts.jsonl", {"tokens": [5, 6, 7]}, "", {"tokens": list(range(40, 70))})
    out_json = tmp_path / "results.json"
    assert cli.main(["--model", str(tiny_hf_dir), "--data", data, "--task", "generate", "--max-new-tokens", "4",
                     "--no-compile", "--compare-eager", "--json", str(out_json)]) == 0
    assert "generated tokens" in capsys.readouterr().out
    results = json.loads(out_json.read_text())
    assert str(tiny_hf_dir) in results["model"] and results["step"] == "eager (not compiled)"
    assert results["recompiles_after_warmup"] is None
    assert results["sequences"] == 2 and results["new_tokens"] == 8 and results["tokens"] == 3 + 30 + 8
    assert [len(o) for o in results["outputs"]] == [4, 4]
    eager = results["eager"]
    assert eager["sequences"] == 2 and eager["new_tokens"] == 8 and eager["tokens"] == (3 + 4 - 1) + (30 + 4 - 1)
    assert eager["token_agreement"] >= 0.5 and eager["mean_abs_logprob_diff"] < 0.05


def test_torchrun_runs_the_checkpoint_tensor_parallel(tmp_path, tiny_hf_dir):
    """``torchrun --nproc-per-node 2 -m dsv4_compile`` on the CPU (gloo): each rank loads its shards
    of the checkpoint, the first prints the summary, and the perplexity is the one process's up to
    the ranks' reduction order (measured: 526.71 against 525.56, 0.002 nats a token)."""
    data = _jsonl(tmp_path / "tokens.jsonl", {"tokens": [5, 6, 7]}, {"tokens": list(range(40, 70))})
    args = ["--model", str(tiny_hf_dir), "--data", data, "--no-compile", "--json"]
    assert cli.main([*args, str(tmp_path / "one.json")]) == 0
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "dsv4_compile", *args, str(tmp_path / "tp.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-3000:]
    assert done.stdout.count("tokens/s") == 1  # one summary
    one, tp = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("one", "tp"))
    assert tp["step"] == "eager (not compiled); tensor-parallel over 2 ranks" and tp["eager"] is None
    assert tp["scored_tokens"] == one["scored_tokens"] == 31
    assert abs(math.log(tp["perplexity"] / one["perplexity"])) < 0.01
