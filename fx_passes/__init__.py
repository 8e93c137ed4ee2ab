"""Custom Inductor FX passes over ``dsv4::`` op graphs (installed as ``dsv4_compile.fx_passes``).

Passes see the post-grad graph: Inductor hands it to ``post_grad_custom_post_pass`` after
functionalization and dead-code elimination, so the metadata and cache ops appear as plain
``dsv4.*`` nodes, the mutating ones wrapped in ``auto_functionalized_v2`` (the op is the node's
first argument, the mutated buffers its keyword arguments).
"""

if __name__ != "dsv4_compile.fx_passes":  # installed from the top-level fx_passes/ folder
    raise ImportError(f"import dsv4_compile.fx_passes, not {__name__!r}")

from .base import DSV4InductorPass  # noqa: E402
from .fuse_attention_inverse_rope import FuseAttentionInverseRopePass  # noqa: E402
from .fuse_collapse_linears import FuseCollapseLinearsPass  # noqa: E402
from .fuse_entry_store import FuseEntryStorePass  # noqa: E402
from .fuse_grouped_linear import FuseGroupedLinearPass  # noqa: E402
from .fuse_key_store import FuseKeyStorePass  # noqa: E402
from .fuse_norm_rope import FuseNormRopePass  # noqa: E402
from .fuse_shared_input_linears import FuseSharedInputLinearsPass  # noqa: E402
from .fuse_sinkhorn import FuseSinkhornPass  # noqa: E402
from .fuse_step_metadata import FuseStepMetadataPass  # noqa: E402
from .inplace_mutations import InplaceMutationsPass  # noqa: E402
from .overlap_cache_writes import OverlapCacheWritesPass  # noqa: E402
from .pass_manager import DSV4PassManager  # noqa: E402
from .replace_short_topk import ReplaceShortTopkPass  # noqa: E402

__all__ = ["DSV4InductorPass", "DSV4PassManager", "FuseAttentionInverseRopePass", "FuseCollapseLinearsPass",
           "FuseEntryStorePass",
           "FuseGroupedLinearPass", "FuseKeyStorePass", "FuseNormRopePass", "FuseSharedInputLinearsPass",
           "FuseSinkhornPass", "FuseStepMetadataPass", "InplaceMutationsPass", "OverlapCacheWritesPass",
           "ReplaceShortTopkPass"]
