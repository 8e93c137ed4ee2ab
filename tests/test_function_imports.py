"""Imports inside the package's functions name plain modules. Such an import may run inside a
Dynamo trace (the compiled model step calls e.g. ``hf_experts.runs_moe_experts_op``), and torch
2.11's Dynamo refuses an import whose result is not a plain module ("Bad import result"): e.g.
``from transformers.models.deepseek_v4 import modeling_deepseek_v4``, whose package is
transformers' lazy module. torch 2.13 traces it, so without this check only the GPU tests (on
2.11) see it."""

import ast
import importlib
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for folder in ("dsv4_compile", "ops", "fx_passes") for p in (ROOT / folder).rglob("*.py"))


def _function_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of each absolute ``import`` / ``from ... import`` inside a function of
    ``path``, once (a nested function's imports are inside its outer function's too)."""
    found = set()
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add((node.lineno, node.module))
            elif isinstance(node, ast.Import):
                found.update((node.lineno, alias.name) for alias in node.names)
    return sorted(found)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_function_level_imports_name_plain_modules(path):
    lazy = []
    for line, module in _function_imports(path):
        try:
            imported = importlib.import_module(module)
        except ImportError:
            continue  # an optional dependency not installed here
        if type(imported) is not types.ModuleType:
            lazy.append(f"line {line}: {module} is a {type(imported).__name__}")
    assert not lazy, f"{path.name}: import from the module that defines the name instead: " + "; ".join(lazy)


def test_the_check_sees_a_lazy_package(tmp_path):
    source = tmp_path / "example.py"
    source.write_text("def f():\n    from transformers.models.deepseek_v4 import modeling_deepseek_v4\n")
    (line, module), = _function_imports(source)
    assert line == 2 and type(importlib.import_module(module)) is not types.ModuleType
