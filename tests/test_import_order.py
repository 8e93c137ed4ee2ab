"""Modules that use ``torch.ops.dsv4`` import the op library themselves: each imports in a fresh
interpreter, also when the package's ``__init__`` (which imports ``ops`` first) has not run."""

import subprocess
import sys

import pytest

MODULES = ["dsv4_compile.step", "dsv4_compile.fx_passes", "dsv4_compile.compile"]

# The package as an empty module on its own path: submodules import, its __init__ does not run.
_BARE_PACKAGE = """
import importlib.util, sys, types
spec = importlib.util.find_spec("dsv4_compile")
package = types.ModuleType("dsv4_compile")
package.__path__ = list(spec.submodule_search_locations)
sys.modules["dsv4_compile"] = package
"""

_IMPORT = """
import importlib, torch
importlib.import_module({module!r})
torch.ops.dsv4.step_metadata.default, torch.ops.dsv4.expand_queries.default
"""


@pytest.mark.parametrize("bare_package", [False, True], ids=["package", "bare_package"])
@pytest.mark.parametrize("module", MODULES)
def test_imports_in_a_fresh_interpreter(module, bare_package):
    code = (_BARE_PACKAGE if bare_package else "") + _IMPORT.format(module=module)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
