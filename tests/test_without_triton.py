"""Without Triton the package still imports and every op runs its reference (CPU-only platforms)."""

import subprocess
import sys

SCRIPT = r"""
import importlib.abc, sys
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton blocked for this test")
sys.meta_path.insert(0, NoTriton())
import torch
import dsv4_compile
from dsv4_compile.ops import _library
assert not _library.HAS_TRITON and "triton" not in sys.modules
cache = torch.zeros(2, dsv4_compile.layout.model1_page_bytes(2), dtype=torch.uint8)
torch.ops.dsv4.store_kv(cache, torch.tensor([3]), torch.ones(1, 512, dtype=torch.bfloat16), 2)
assert torch.equal(torch.ops.dsv4.dequant_kv(cache, torch.tensor([3]), 2), torch.ones(1, 512, dtype=torch.bfloat16))
print("ok")
"""


def test_package_works_without_triton():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
