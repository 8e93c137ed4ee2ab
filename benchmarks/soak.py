"""Soak: a long random serving run with sampled per-layer oracle checks (not part of CI).

Requests are admitted at random, prefilled in random chunks (chunked prefill, several requests
per step), then decoded, or verified with random draft counts (uniform or ragged, up to the
config's ``max_draft_tokens``) and random rejection, and released when they reach their random
length; idle steps come in between. Every ``--check-every`` steps the rows of the step just run
are checked layer by layer against the cache-free oracle on the very inputs each layer saw
(``OracleRecorder.layer_errors``), and one random live request's cached entries (SWA window, c4 /
c128 entries, indexer keys) against the oracle's (``OracleRecorder.cache_errors``). The layer
hooks that record those inputs stay on for the whole run (compiled too: they are traced into the
graph), so every request is teacher forced.

Reports steps per mode, tokens, tokens/s, the worst per-layer and per-kind cache errors, and
memory over time (RSS on CPU; ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` on GPU),
as text and, with ``--json``, as a JSON file::

    python benchmarks/soak.py --minutes 30 --device cuda --compile --json soak.json
    python benchmarks/soak.py --minutes 2                           # eager, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

from dsv4_compile import DSV4AttnConfig, ForwardMode
from dsv4_compile.compile import compile_step
from dsv4_compile.step import REQUEST_BUCKETS
from dsv4_compile.testing.oracle_recorder import make_engine

M = ForwardMode


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=1.0, help="run length (wall clock)")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps instead (0: use --minutes)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true", help="compile_step (CUDA graphs on a GPU)")
    p.add_argument("--backend", default="inductor", help="compile_step's backend (with --compile)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--index-topk", type=int, default=64)
    p.add_argument("--max-requests", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--max-prompt", type=int, default=600)
    p.add_argument("--max-new", type=int, default=300, help="most tokens generated per request")
    p.add_argument("--chunk", type=int, default=256, help="largest prefill chunk")
    p.add_argument("--check-every", type=int, default=10, help="oracle checks every N steps (0: never)")
    p.add_argument("--memory-every", type=float, default=10.0, help="seconds between memory samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
    return p.parse_args(argv)


def memory_bytes(device: torch.device) -> dict[str, int]:
    if device.type == "cuda":
        return {"allocated": torch.cuda.memory_allocated(device),
                "max_allocated": torch.cuda.max_memory_allocated(device)}
    with open("/proc/self/statm") as f:
        return {"rss": int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")}


class Soak:
    """The serving state of one run: requests prefilling (prompt tokens left) and decoding, each
    request's final length, step and token counts, and the worst errors seen."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        config = DSV4AttnConfig.from_name(args.preset).with_(index_topk=args.index_topk)
        self.engine, self.recorder = make_engine(config, max_requests=args.max_requests,
                                                 max_seq_len=args.max_seq_len, seed=args.seed,
                                                 device=args.device, capture_layers=True)
        if args.compile:
            self.engine.forward = compile_step(self.engine.stack, backend=args.backend)
            self.engine.bucketed = True
        self.max_drafts = config.max_draft_tokens
        self.prefilling: dict[int, int] = {}
        self.decoding: set[int] = set()
        self.final_length: dict[int, int] = {}
        self.steps = {m.value: 0 for m in M if m is not M.DRAFT_EXTEND}
        self.tokens = self.accepted = self.checks = 0
        self.layer_errors = [0.0] * config.num_layers
        self.cache_errors: dict[str, float] = {}

    def _length(self, row: int) -> int:
        return self.engine.allocator.seq_len(row)

    def _release_and_admit(self) -> None:
        for row in [r for r in self.decoding if self._length(r) >= self.final_length[r]]:
            self.engine.release(row)
            self.decoding.discard(row)
        while len(self.prefilling) + len(self.decoding) < self.args.max_requests and self.rng.random() < 0.3:
            row = self.engine.admit()
            prompt = self.rng.randint(1, self.args.max_prompt)
            self.prefilling[row] = prompt
            longest = self.args.max_seq_len - self.max_drafts
            self.final_length[row] = min(prompt + self.rng.randint(1, self.args.max_new), longest)

    def _choose(self) -> tuple[ForwardMode, dict[int, int]]:
        """The next step: a prefill chunk of some prefilling requests, a decode or a verify of the
        decoding ones, or an idle step."""
        if self.prefilling and (not self.decoding or self.rng.random() < 0.4):
            rows = self.rng.sample(sorted(self.prefilling), self.rng.randint(1, len(self.prefilling)))
            return M.EXTEND, {r: min(self.prefilling[r], self.rng.randint(1, self.args.chunk)) for r in rows}
        if not self.decoding or self.rng.random() < 0.03:
            return M.IDLE, {}
        rows = sorted(self.decoding)
        if self.rng.random() < 0.35:
            d = self.rng.randint(1, self.max_drafts)
            ragged = self.rng.random() < 0.5
            return M.TARGET_VERIFY, {r: self.rng.randint(1, self.max_drafts) if ragged else d for r in rows}
        return M.DECODE, {r: 1 for r in rows}

    def step(self, index: int) -> None:
        """One step: release / admit, run, check (every ``--check-every`` steps), then roll back
        rejected drafts and move prefilled requests to decoding."""
        self._release_and_admit()
        mode, tokens = self._choose()
        self.steps[mode.value] += 1
        if mode is M.IDLE:
            self.engine.idle(self.rng.choice(REQUEST_BUCKETS[:4]))
            return
        self.recorder.run(mode, tokens)
        self.tokens += sum(tokens.values())
        if self.args.check_every and index % self.args.check_every == 0:
            self._check(list(tokens))
        for row, n in tokens.items():
            if mode is M.TARGET_VERIFY:
                keep = self.rng.randint(0, n)
                self.engine.accept(row, keep, n)
                self.accepted += keep
            elif mode is M.EXTEND:
                self.prefilling[row] -= n
                if not self.prefilling[row]:
                    del self.prefilling[row]
                    self.decoding.add(row)

    def _check(self, rows: list[int]) -> None:
        """Per-layer errors of the step's rows, and one random live request's cache entries."""
        self.checks += 1
        forced = [r for r in rows if self.recorder.teacher_forced(r)]
        for i, err in enumerate(self.recorder.layer_errors(forced)):
            self.layer_errors[i] = max(self.layer_errors[i], err)
        live = sorted(self.decoding | set(self.prefilling))
        row = self.rng.choice(live)
        if self._length(row):
            for kind, err in self.recorder.cache_errors(row).items():
                self.cache_errors[kind] = max(self.cache_errors.get(kind, 0.0), err)


def run(args: argparse.Namespace) -> dict:
    """The soak; returns the report."""
    soak = Soak(args)
    device = soak.engine.device
    start = last_sample = time.perf_counter()
    memory = [(0.0, memory_bytes(device))]
    index = 0
    with torch.no_grad():
        while (index < args.steps) if args.steps else (time.perf_counter() - start < 60 * args.minutes):
            soak.step(index)
            index += 1
            now = time.perf_counter()
            if now - last_sample >= args.memory_every:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                memory.append((round(now - start, 1), memory_bytes(device)))
                last_sample = now
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    memory.append((round(seconds, 1), memory_bytes(device)))
    return {"args": vars(args), "seconds": round(seconds, 1), "steps": index, "steps_by_mode": soak.steps,
            "tokens": soak.tokens, "accepted_draft_tokens": soak.accepted,
            "tokens_per_s": round(soak.tokens / seconds, 1), "checks": soak.checks,
            "worst_layer_error": soak.layer_errors, "worst_cache_error": soak.cache_errors,
            "memory": memory}


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    mem = report["memory"][-1][1]
    print(f"soak: {report['steps']} steps {report['steps_by_mode']} in {report['seconds']} s, "
          f"{report['tokens']} tokens ({report['tokens_per_s']} tokens/s), {report['checks']} checks")
    print("worst per-layer error: " + ", ".join(f"{e:.4f}" for e in report["worst_layer_error"]))
    print("worst cache error: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(report["worst_cache_error"].items())))
    print(f"memory: first {report['memory'][0][1]}, last {mem} ({len(report['memory'])} samples)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
