"""The lm-eval model ``dsv4`` (``dsv4_compile/lm_eval_model.py``) against lm-eval's own ``hf`` model
on the tiny checkpoint, offline: a multiple-choice task from a local JSONL (per-request
log-likelihoods, accuracy), rolling log-likelihood over several windows, generation cut at a stop
string, sampling seeded by torch, and the command line.

Bounds. The backend's per-token log-probs differ from transformers bf16 by the FP8 cache's noise:
mean 0.009-0.013, max 0.051 nats on this model, bounded by 0.025 and 0.1 in
``tests/model/test_runner.py``. lm-eval's ``hf`` model rounds each token's log-prob to bf16 and sums
them in bf16: ``n`` roundings of at most 2⁻⁹ of the running total, so a request of ``n`` scored
tokens with ``hf`` log-likelihood ``ℓ`` may differ by ``0.1 n + n 2⁻⁹ |ℓ|`` (each request), and by
``0.025 n + n 2⁻⁹ |ℓ|`` summed over the requests.
"""

import json
import os
import random
import shutil
import string
import subprocess
import sys

import pytest
import torch

os.environ["HF_DATASETS_OFFLINE"] = "1"  # before lm-eval imports datasets: local files only
lm_eval = pytest.importorskip("lm_eval")

import dsv4_compile.lm_eval_model  # noqa: E402,F401  (registers the model dsv4)
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from tests.support.tokenizer import WORDS, sentence, train_tokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

MAX_LENGTH = 64  # lm-eval's context: short, so that a rolling document spans several windows
PER_TOKEN_MAX, PER_TOKEN_MEAN = 0.1, 0.025
TASK_YAML = string.Template("""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: $data
  cache_dir: $cache
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")


def allowed(n: int, hf_ll: float, per_token: float) -> float:
    """The difference allowed between our and hf's log-likelihood of ``n`` scored tokens (above)."""
    return per_token * n + n * 2**-9 * abs(hf_ll)


@pytest.fixture(scope="module")
def eval_dir(tiny_hf_dir, tmp_path_factory):
    """The tiny checkpoint with a locally trained tokenizer beside it."""
    path = tmp_path_factory.mktemp("tiny_eval")
    shutil.copytree(tiny_hf_dir, path, dirs_exist_ok=True)
    train_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """A folder with the task ``tiny_mc``: 10 questions of 3 answers each (1 to 5 words), from a JSONL."""
    path, rng = tmp_path_factory.mktemp("tasks"), random.Random(1)
    docs = [{"question": sentence(rng, rng.randint(4, 10)),
             "choices": [sentence(rng, rng.randint(1, 5)) for _ in range(3)], "answer": rng.randrange(3)}
            for _ in range(10)]
    (path / "mc.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (path / "tiny_mc.yaml").write_text(TASK_YAML.substitute(data=path / "mc.jsonl", cache=path / "cache"))
    return path


@pytest.fixture(scope="module")
def dsv4_lm(eval_dir):
    """``dsv4`` by its registered name: 16 request rows of 256 tokens, eager."""
    return get_model("dsv4").create_from_arg_string(
        f"pretrained={eval_dir},max_seq_len=256,max_length={MAX_LENGTH},batch_size=16",
        {"batch_size": 1, "device": "cpu"})  # lm-eval's default batch_size: model_args take precedence


@pytest.fixture(scope="module")
def hf_lm(eval_dir):
    return get_model("hf").create_from_arg_string(f"pretrained={eval_dir},dtype=bfloat16,max_length={MAX_LENGTH}",
                                                  {"batch_size": 16, "device": "cpu"})


def evaluate(lm, task_dir) -> dict:
    return lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc"], task_manager=TaskManager(include_path=str(task_dir)),
                                   log_samples=True)


def request(kind: str, *arguments) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=arguments, idx=0)


def test_multiple_choice_matches_hf(dsv4_lm, hf_lm, task_dir):
    ours, theirs = evaluate(dsv4_lm, task_dir), evaluate(hf_lm, task_dir)
    assert dsv4_lm.batch_size == 16
    diffs, total_allowed = [], 0.0
    for doc_ours, doc_hf in zip(ours["samples"]["tiny_mc"], theirs["samples"]["tiny_mc"], strict=True):
        assert doc_ours["arguments"] == doc_hf["arguments"]
        for (context, continuation), [(ll, _)], [(hf_ll, _)] in zip(doc_ours["arguments"], doc_ours["resps"],
                                                                      doc_hf["resps"], strict=True):
            n = len(dsv4_lm._encode_pair(context, continuation)[1])
            assert abs(ll - hf_ll) <= allowed(n, hf_ll, PER_TOKEN_MAX), (context, continuation, ll, hf_ll)
            diffs.append(abs(ll - hf_ll))
            total_allowed += allowed(n, hf_ll, PER_TOKEN_MEAN)
    assert len(diffs) == 30 and sum(diffs) <= total_allowed, (sum(diffs), total_allowed)
    acc, hf_acc = ours["results"]["tiny_mc"]["acc,none"], theirs["results"]["tiny_mc"]["acc,none"]
    print(f"|Δ log-likelihood| mean {sum(diffs) / len(diffs):.4f} max {max(diffs):.4f}; acc {acc} (hf {hf_acc})")
    assert acc == hf_acc


def test_rolling_matches_hf(dsv4_lm, hf_lm):
    """A short document (one window) and a long one (windows of MAX_LENGTH tokens)."""
    rng = random.Random(2)
    texts = [sentence(rng, 8), " ".join(rng.choice(WORDS) + rng.choice(".,;") for _ in range(70))]
    assert len(dsv4_lm.tok_encode(texts[1])) > 2 * MAX_LENGTH
    requests = [request("loglikelihood_rolling", text) for text in texts]
    ours, theirs = dsv4_lm.loglikelihood_rolling(requests), hf_lm.loglikelihood_rolling(requests)
    for text, ll, hf_ll in zip(texts, ours, theirs, strict=True):
        n = len(dsv4_lm.tok_encode(text))
        print(f"{n} tokens: {ll:.3f} (hf {hf_ll:.3f})")
        assert abs(ll - hf_ll) <= allowed(n, hf_ll, PER_TOKEN_MAX), (n, ll, hf_ll)


def test_generate_until_cuts_at_stop_string(dsv4_lm, monkeypatch):
    """Greedy text without a stop string; then a stop string from its middle ends the generation at
    the token that completes it, and the text is cut before it."""
    context = "the cat sat on the"
    free = dsv4_lm.generate_until([request("generate_until", context, {"until": [], "max_gen_toks": 12})])[0]
    assert len(free) >= 6, free
    stop = free[len(free) // 2:len(free) // 2 + 2]
    generated = []
    generate = dsv4_lm.runner.generate
    monkeypatch.setattr(dsv4_lm.runner, "generate", lambda *a, **k: generated.extend(generate(*a, **k)) or generated)
    kwargs = {"until": [stop], "max_gen_toks": 12, "do_sample": False}
    assert dsv4_lm.generate_until([request("generate_until", context, kwargs)]) == [free[:free.index(stop)]]
    [tokens] = generated
    assert len(tokens) < 12 and stop in dsv4_lm.tok_decode(tokens) and stop not in dsv4_lm.tok_decode(tokens[:-1])


def test_generate_until_sampling_follows_torch_seed(dsv4_lm):
    requests = [request("generate_until", "a bird sings", {"do_sample": True, "temperature": 1.0,
                                                             "max_gen_toks": 4})]
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(dsv4_lm.generate_until(requests))
    assert runs[0] == runs[1]
    with pytest.raises(ValueError, match="not \\['repetition_penalty'\\]"):
        dsv4_lm.generate_until([request("generate_until", "a", {"repetition_penalty": 1.1, "max_gen_toks": 4})])


def test_generate_until_stops_and_samples_as_hf_generate(dsv4_lm, monkeypatch):
    """What the hf model's ``generate`` applies where gen_kwargs are silent reaches the runner: the
    generation config's EOS ids beside the tokenizer's, its top_k (else transformers' 50) and top_p;
    a stop string that is a special token's text (a chat turn's end) ends the continuation, as the
    hf model's stop criteria decode with special tokens kept, and is cut from the text."""
    tok, config = dsv4_lm.tokenizer, dsv4_lm.runner.backend.model.generation_config
    word, special = tok.encode(" cat")[0], tok.bos_token_id
    calls = []
    monkeypatch.setattr(dsv4_lm.runner, "generate", lambda prompts, n, **kw: calls.append(kw) or [[word, special]])
    monkeypatch.setattr(config, "eos_token_id", [tok.eos_token_id, 7])
    monkeypatch.setattr(config, "top_k", None)
    kwargs = {"until": [tok.bos_token], "max_gen_toks": 4, "do_sample": True, "temperature": 0.8}
    assert dsv4_lm.generate_until([request("generate_until", "a", kwargs)]) == [tok.decode([word])]
    assert calls[-1]["stop"](0, [word, special]) and not calls[-1]["stop"](0, [word])
    assert calls[-1]["stop_ids"] == {tok.eos_token_id, 7}
    assert (calls[-1]["temperature"], calls[-1]["top_k"], calls[-1]["top_p"]) == (0.8, 50, 1.0)
    monkeypatch.setattr(config, "top_k", 20)
    dsv4_lm.generate_until([request("generate_until", "a", kwargs)])
    dsv4_lm.generate_until([request("generate_until", "a", {**kwargs, "top_k": 5, "top_p": 0.9})])
    assert [(c["top_k"], c["top_p"]) for c in calls[-2:]] == [(20, 1.0), (5, 0.9)]


def test_chat_template_and_batch_size_auto(eval_dir, dsv4_lm, monkeypatch):
    """``--apply_chat_template`` renders through the tokenizer's template, and names the tokenizer
    for lm-eval's cache; ``batch_size=auto`` is the default batch size (the cache's rows are sized
    up front, nothing to search)."""
    monkeypatch.setattr(dsv4_lm.tokenizer, "chat_template",
                        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
    chat = [{"role": "user", "content": "the cat"}]
    assert dsv4_lm.apply_chat_template(chat) == "<user>the cat<assistant>"
    assert dsv4_lm.tokenizer_name == str(eval_dir).replace("/", "__")
    auto = get_model("dsv4").create_from_arg_string(f"pretrained={eval_dir},max_seq_len=256",
                                                     {"batch_size": "auto", "device": "cpu"})
    assert auto.batch_size == dsv4_compile.lm_eval_model.DEFAULT_BATCH_SIZE


def test_chat_template_without_system_role_drops_system_messages(dsv4_lm, monkeypatch):
    """A template that refuses the system role (lm-eval's ``--system_instruction`` adds one) renders
    the history without its system messages, as lm-eval's hf model retries, rather than raising."""
    monkeypatch.setattr(dsv4_lm.tokenizer, "chat_template",
                        "{% for m in messages %}{% if m.role == 'system' %}"
                        "{{ raise_exception('System role not supported') }}{% endif %}"
                        "<{{ m.role }}>{{ m.content }}{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the cat"}]
    assert dsv4_lm.apply_chat_template(chat) == "<user>the cat<assistant>"


def test_add_bos_token_and_prefix_token_id_match_hf(eval_dir, dsv4_lm):
    """``add_bos_token`` and ``prefix_token_id`` as lm-eval's hf model takes them: this tokenizer adds
    no BOS of its own, so with ``add_bos_token=true`` every encoding starts with BOS; an empty
    context conditions on ``prefix_token_id``; the log-likelihoods follow hf's."""
    args = f"pretrained={eval_dir},max_length={MAX_LENGTH},add_bos_token=true,prefix_token_id=1"
    lm = get_model("dsv4").create_from_arg_string(f"{args},max_seq_len=256,batch_size=2", {"device": "cpu"})
    hf = get_model("hf").create_from_arg_string(f"{args},dtype=bfloat16", {"batch_size": 2, "device": "cpu"})
    bos = lm.tokenizer.bos_token_id
    assert lm.tok_encode("the cat") == [bos, *dsv4_lm.tok_encode("the cat")] == hf.tok_encode("the cat")
    # a string that starts with the prefix token's text (EOS here) gets no special tokens added
    assert lm.tok_encode("</s>the cat") == hf.tok_encode("</s>the cat") == dsv4_lm.tok_encode("</s>the cat")
    assert lm.prefix_token_id == hf.prefix_token_id == 1
    requests = [request("loglikelihood", "the cat sat", " on the mat"), request("loglikelihood", "", "a bird")]
    ours, theirs = lm.loglikelihood(requests), hf.loglikelihood(requests)
    for (ll, _), (hf_ll, _), n in zip(ours, theirs, (len(lm._encode_pair("the cat sat", " on the mat")[1]), 2)):
        assert abs(ll - hf_ll) <= allowed(n, hf_ll, PER_TOKEN_MAX), (ll, hf_ll)


def test_command_line(eval_dir, task_dir):
    """``python -m dsv4_compile.lm_eval_model`` is lm-eval's command line with ``dsv4`` registered;
    ``--batch_size`` (lm-eval's, default 1) and ``batch_size`` in ``--model_args`` do not clash."""
    args = ["--model", "dsv4", "--model_args", f"pretrained={eval_dir},max_seq_len=256,batch_size=8",
            "--tasks", "tiny_mc", "--include_path", str(task_dir), "--limit", "2", "--device", "cpu"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "dsv4_compile.lm_eval_model", *args], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tiny_mc" in run.stdout and "acc" in run.stdout, run.stdout


@pytest.mark.parametrize("arg, named", [("batch_size=2.7", "batch_size must be a positive integer, got 2.7"),
                                        ("max_seq_len=0", "max_seq_len must be a positive integer"),
                                        ("device=meta", "device 'meta': only cpu and cuda are supported"),
                                        ("device=cuda:99", "device 'cuda:99'"),
                                        ("add_bos_token=maybe", "add_bos_token must be true or false"),
                                        ("prefix_token_id=-1", "prefix_token_id must be a token id")])
def test_bad_model_args_are_refused_by_name_before_loading(eval_dir, monkeypatch, arg, named):
    """A model argument that cannot be used raises naming it, before the checkpoint is read."""
    monkeypatch.setattr("dsv4_compile.lm_eval_model.AutoTokenizer.from_pretrained",
                        lambda *a, **k: pytest.fail("the checkpoint was read"))
    with pytest.raises(ValueError, match=named):
        get_model("dsv4").create_from_arg_string(f"pretrained={eval_dir},max_seq_len=256,{arg}", {})
