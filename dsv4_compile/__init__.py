"""dsv4-compile: DeepSeek V4 sparse attention as torch.compile-native custom ops.

Importing the package registers every ``torch.ops.dsv4.*`` operator.
"""

from . import ops  # noqa: F401  (registers the dsv4:: ops)
from .allocator import OutOfPagesError, PageAllocator
from .attention import KVSet, sparse_attn
from .cache import DSV4Cache, LayerCache
from .config import DSV4AttnConfig
from .layer import DSV4Attention, DSV4AttentionStack
from .model import ModelBackend, enable
from .oracle import oracle_layer, oracle_stack
from .runner import ModelRunner
from .step import ForwardMode, StepInputs, StepMetadata, build_step_metadata

__all__ = [
    "DSV4Attention", "DSV4AttentionStack", "DSV4AttnConfig", "DSV4Cache", "ForwardMode", "KVSet", "LayerCache",
    "ModelBackend", "ModelRunner", "OutOfPagesError", "PageAllocator", "StepInputs", "StepMetadata", "build_step_metadata",
    "enable", "oracle_layer", "oracle_stack", "sparse_attn",
]
