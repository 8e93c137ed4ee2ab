"""README's Python snippets run as written, in order, in one namespace (each continues the last)."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_snippets_run():
    blocks = _python_blocks()
    assert len(blocks) >= 2
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i}", "exec"), namespace)
    # the compiled decode step wrote its token and returned one row per padded token row
    out, cfg = namespace["out"], namespace["cfg"]
    assert out.shape == (namespace["num_tokens"], cfg.hidden_size) and torch.isfinite(out).all()


def test_readme_starts_with_the_two_commands():
    head = README.read_text().splitlines()[:6]
    assert any("python -m dsv4_compile" in line for line in head)
    assert any("python -m pytest" in line for line in head)
