"""An evaluation's results as a plain-text summary table (the command's output) and as JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path


def summary(results: dict) -> str:
    """The results of :func:`dsv4_compile.evaluate.evaluate` as an aligned two-column table."""
    rows = [("model", results["model"]), ("device", results["device"]), ("step", results["step"]),
            ("task", results["task"]),
            ("sequences", f"{results['sequences']:,} ({results['min_length']}..{results['max_length']} tokens)"),
            ("tokens", f"{results['tokens']:,}" + _new_tokens(results)),
            ("tokens/s", f"{results['tokens_per_s']:,.1f} (compilation and warm-up excluded)"),
            ("warm-up", f"{results['warmup_s']:.1f} s, compilation {results['compile_s']:.1f} s in all"),
            ("recompiles after warm-up", "n/a (not compiled)" if results["recompiles_after_warmup"] is None
             else str(results["recompiles_after_warmup"]))]
    if "perplexity" in results:
        rows.append(("perplexity", f"{results['perplexity']:.3f}"))
    rows += _eager_rows(results.get("eager"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _new_tokens(results: dict) -> str:
    new = results.get("new_tokens")
    return f" ({results['tokens'] - new:,} prompt + {new:,} generated)" if new is not None else ""


def _eager_rows(eager: dict | None) -> list[tuple[str, str]]:
    if eager is None:
        return []
    worst = _num(eager["max_abs_logprob_diff"])
    rows = [("vs transformers eager", f"{eager['sequences']} sequences, {eager['tokens']:,} positions"),
            ("  mean |Δ log-prob|", f"{_num(eager['mean_abs_logprob_diff'])} (max {worst})"),
            ("  greedy agreement", _percent(eager["greedy_agreement"]))]
    if "token_agreement" in eager:
        rows += [("  generated tokens", f"{_percent(eager['token_agreement'])} the same, "
                  f"{eager['identical_continuations']}/{eager['sequences']} continuations identical")]
    return rows


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def write_json(results: dict, path: Path) -> None:
    """``results`` as JSON at ``path`` (non-finite numbers as null)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in results.items()}
    path.write_text(json.dumps(clean, indent=2) + "\n")
