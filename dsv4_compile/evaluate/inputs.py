"""What an evaluation runs on: the model (built-in or a checkpoint) and the corpus (built-in or a
JSONL file), checked before anything heavy is built.

Every problem with them is an :class:`InputError` whose message names it — the option, the file
and line, the sequence — so that the command can print it as one line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoTokenizer, DeepseekV4Config, DeepseekV4ForCausalLM, PretrainedConfig
from transformers.distributed import DistributedConfig

from ..config import DSV4AttnConfig
from ..parallel import ATTENTION_TP_PLAN
from ..testing.random_model import random_hf_model

# The built-in model: every attention layer type (sliding, CSA, HCA), a hash-routed and a learned
# MoE layer, four hyper-connection streams; real head dimensions, everything else small.
BUILTIN_CONFIG = Path(__file__).with_name("default_model.json")
# The built-in corpus: sequence count, range of lengths, skew. Length i of n is
# lo * (hi / lo) ** ((i / (n - 1)) ** skew): most sequences are short (median 17 tokens, 10k tokens
# in all: the default run stays within minutes on 2 CPU cores), 9 pass 256 tokens (more c4 entries
# than the built-in model's index_topk of 64, and several c128 entries).
BUILTIN_SEQUENCES, BUILTIN_LENGTHS, BUILTIN_SKEW = 200, (16, 600), 6.0


class InputError(Exception):
    """A bad input, described in one line (the command exits with status 2)."""


def check_device(name: str | None, local_rank: int | None = None, *, what: str = "--device") -> torch.device:
    """``name`` as a usable device (default: ``cuda`` when available, else ``cpu``); under torchrun
    (``local_rank``) the rank's own ``cuda:LOCAL_RANK``. :class:`InputError` otherwise, naming
    ``what`` (the option or argument that gave it)."""
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise InputError(f"{what} {name!r} is not a device name; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise InputError(f"{what} {name!r}: only cpu and cuda are supported")
    if local_rank is not None:
        if device.index is not None:
            raise InputError(f"{what} {name!r}: under torchrun each rank runs on cuda:LOCAL_RANK; pass --device cuda")
        device = torch.device("cuda", local_rank)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        raise InputError(f"{what} {name!r}: no CUDA device is available")
    if (device.index or 0) >= count:
        raise InputError(f"{what} {name!r}: this machine has {count} CUDA device(s)")
    return device


def check_output_file(flag: str, path: Path) -> None:
    """:class:`InputError` unless a file can be written at ``path`` (checked before any work)."""
    if not path.parent.is_dir():
        raise InputError(f"{flag} {path}: no directory {path.parent}")
    if path.is_dir() or not os.access(path.parent, os.W_OK):
        raise InputError(f"{flag} {path}: cannot write a file there")


def check_tp_size(config: PretrainedConfig, tp_size: int) -> None:
    """:class:`InputError` unless ``config``'s model splits over ``tp_size`` tensor-parallel ranks."""
    try:
        DSV4AttnConfig.from_hf(config, tp_size=tp_size)
    except ValueError as e:
        raise InputError(f"{tp_size} processes: {e}") from None


@dataclass
class Corpus:
    """Token sequences and, for messages, where each one comes from (``labels``)."""

    sequences: list[list[int]]
    labels: list[str]

    def head(self, n: int | None) -> "Corpus":
        """The first ``n`` sequences (all when ``n`` is None)."""
        return Corpus(self.sequences[:n], self.labels[:n])

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.sequences))


def builtin_config() -> DeepseekV4Config:
    return DeepseekV4Config.from_json_file(BUILTIN_CONFIG)


def builtin_model(device: torch.device, seed: int) -> DeepseekV4ForCausalLM:
    """The built-in config with bf16 weights drawn from ``seed``, built on ``device``."""
    return random_hf_model(builtin_config(), seed=seed, device=device)


def builtin_corpus(vocab_size: int, seed: int, count: int = BUILTIN_SEQUENCES) -> Corpus:
    """``count`` sequences of uniformly drawn token ids in ``[0, vocab_size)``, lengths spread over
    :data:`BUILTIN_LENGTHS` (see :data:`BUILTIN_SKEW`) in a seeded random order."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = BUILTIN_LENGTHS
    spread = torch.linspace(0, 1, count, dtype=torch.float64) ** BUILTIN_SKEW
    lengths = (lo * (hi / lo) ** spread).round().long()[torch.randperm(count, generator=gen)]
    sequences = [torch.randint(0, vocab_size, (int(n),), generator=gen).tolist() for n in lengths]
    return Corpus(sequences, [f"built-in sequence {i}" for i in range(count)])


def checkpoint_config(path: Path) -> PretrainedConfig:
    """The config of the checkpoint directory ``path``, checked to be a DeepSeek V4 model the
    backend runs and to come with safetensors weights."""
    where = f"--model {path}"
    if not path.is_dir():
        raise InputError(f"{where}: no such directory")
    if not (path / "config.json").is_file():
        raise InputError(f"{where}: no config.json in it")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{where}: config.json cannot be read: {_first_line(e)}") from None
    if config.model_type != "deepseek_v4":
        raise InputError(f"{where}: config.json describes a {config.model_type!r} model, not DeepSeek V4 "
                         "('deepseek_v4')")
    try:
        DSV4AttnConfig.from_hf(config)
    except ValueError as e:
        raise InputError(f"{where}: {e}") from None
    if not any(path.glob("*.safetensors")):
        raise InputError(f"{where}: no *.safetensors weights in it")
    return config


def load_checkpoint(path: Path, config: PretrainedConfig, device: torch.device, tp_size: int = 1
                    ) -> DeepseekV4ForCausalLM:
    """The checkpoint as ``from_pretrained(path, dtype=torch.bfloat16)`` loads it, on ``device``;
    with ``tp_size > 1`` (under torchrun) each rank reads only its shards of it
    (:data:`dsv4_compile.parallel.ATTENTION_TP_PLAN` and the model's own plan)."""
    kwargs = {}
    if tp_size > 1:
        kwargs["distributed_config"] = DistributedConfig(tp_size=tp_size, tp_plan=ATTENTION_TP_PLAN)
    try:
        model = DeepseekV4ForCausalLM.from_pretrained(path, config=config, dtype=torch.bfloat16,
                                                      local_files_only=True, use_safetensors=True, **kwargs)
    except (OSError, SafetensorError) as e:  # a missing, truncated or corrupt weights file
        raise InputError(f"--model {path}: cannot read its weights: {_first_line(e)}") from None
    return model.to(device).eval().requires_grad_(False)


def read_jsonl(path: Path, vocab_size: int, tokenizer_dir: Path | None) -> Corpus:
    """The sequences of a JSONL file: one JSON object a line, ``{"tokens": [ids...]}`` or
    ``{"text": "..."}`` (tokenized with the checkpoint's tokenizer from ``tokenizer_dir``); blank
    lines are skipped."""
    if not path.is_file():
        raise InputError(f"--data {path}: no such file")
    tokenize = _lazy_tokenizer(tokenizer_dir)
    sequences, labels = [], []
    try:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    labels.append(f"--data {path} line {number}")
                    sequences.append(_line_tokens(line, labels[-1], vocab_size, tokenize))
    except UnicodeDecodeError:
        raise InputError(f"--data {path}: not UTF-8 text") from None
    if not sequences:
        raise InputError(f"--data {path}: no sequences in it")
    return Corpus(sequences, labels)


def _line_tokens(line: str, where: str, vocab_size: int, tokenize: Callable[[str, str], list[int]]) -> list[int]:
    """The token ids of one JSONL line (``where`` names it in errors)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(record, dict) or len({"tokens", "text"} & record.keys()) != 1:
        raise InputError(f'{where}: expected an object with "tokens" (a list of token ids) or "text"')
    if "text" in record:
        if not isinstance(record["text"], str):
            raise InputError(f'{where}: "text" must be a string')
        tokens = tokenize(record["text"], where)
    else:
        tokens = record["tokens"]
        if not isinstance(tokens, list) or any(type(t) is not int for t in tokens):
            raise InputError(f'{where}: "tokens" must be a list of integer token ids')
    if not tokens:
        raise InputError(f"{where}: no tokens")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InputError(f"{where}: token id {bad} is outside the model's vocabulary [0, {vocab_size})")
    return tokens


def _lazy_tokenizer(tokenizer_dir: Path | None) -> Callable[[str, str], list[int]]:
    """``tokenize(text, where)``, loading the tokenizer at the first text (token ids need none)."""
    loaded = []

    def tokenize(text: str, where: str) -> list[int]:
        if tokenizer_dir is None:
            raise InputError(f'{where}: "text" needs the checkpoint\'s tokenizer (--model DIR); the built-in '
                             'model has none: give "tokens"')
        if not loaded:
            try:
                loaded.append(AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True))
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise InputError(f"--model {tokenizer_dir}: no tokenizer for the texts of --data "
                                 f"({_first_line(e)})") from None
        return list(loaded[0](text)["input_ids"])

    return tokenize


def check_lengths(corpus: Corpus, max_seq_len: int, new_tokens: int) -> None:
    """Every sequence, with ``new_tokens`` generated after it, fits in ``max_seq_len`` positions."""
    for tokens, label in zip(corpus.sequences, corpus.labels):
        if len(tokens) + new_tokens > max_seq_len:
            extra = f" + {new_tokens} new tokens" if new_tokens else ""
            raise InputError(f"{label}: {len(tokens)} tokens{extra} is longer than --max-seq-len {max_seq_len}")


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
