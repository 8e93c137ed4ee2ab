"""The tiny transformers DeepSeek V4 checkpoint (``tests/support/hf_model.py``), written once per
test run with ``save_pretrained`` and read back with ``from_pretrained``, offline."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers reads it: a local checkpoint, no network

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import DeepseekV4ForCausalLM  # noqa: E402

from tests.support.hf_model import tiny_hf_model  # noqa: E402


@pytest.fixture(autouse=True)
def no_grad():
    """Steps are inference only."""
    with torch.no_grad():
        yield


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """Directory of the tiny checkpoint (seed 0, bf16 with transformers' fp32 modules)."""
    path = tmp_path_factory.mktemp("tiny_hf")
    built = tiny_hf_model(seed=0, path=path)
    assert_same_state(built, load_tiny_hf(path))
    return path


@pytest.fixture(scope="session")
def tiny_hf(tiny_hf_dir) -> DeepseekV4ForCausalLM:
    """The tiny model as ``from_pretrained`` loads it: eval mode, no grad. Shared by the whole test run:
    tests must not modify it."""
    return load_tiny_hf(tiny_hf_dir)


def load_tiny_hf(path) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.bfloat16, local_files_only=True)
    return model.eval().requires_grad_(False)


def assert_same_state(expected: torch.nn.Module, actual: torch.nn.Module) -> None:
    """Same saved tensors: names, dtypes and values, bit for bit."""
    want, got = expected.state_dict(), actual.state_dict()
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
