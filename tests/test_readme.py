"""README's Python snippets run as written, in order, in one namespace (each continues the last); the
imports of the docs' snippets resolve."""

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


def test_docs_snippets_import_what_exists():
    """Every import line of the docs' Python snippets (docs/*.md; they need a checkpoint or a GPU
    to run whole) resolves: the names they show live where they say."""
    docs = sorted(README.parent.joinpath("docs").glob("*.md"))
    lines = [line.strip() for doc in docs for block in re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
             for line in block.splitlines() if re.match(r"\s*(from \S+ )?import ", line)]
    assert len(lines) >= 5
    for line in lines:
        exec(line, {})
