"""The ``dsv4::`` operator library. Importing it registers every op.

Each module holds one op family and states each op once through ``_library.dsv4_op``: its schema,
argument check, reference (the kernel of every device), fake (meta) impl and, where one exists,
the Triton launcher registered as the CUDA kernel.
"""

if __name__ != "dsv4_compile.ops":  # the top-level ops/ folder installs as dsv4_compile.ops only
    raise ImportError(f"import dsv4_compile.ops, not {__name__!r}")

from . import (compressor, experts, hyper_connection, indexer, kv_cache, linear, metadata, norm_rope,  # noqa: E402,F401
               sampling, side_stream, sparse_attn)
