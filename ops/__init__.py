"""The ``dsv4::`` operator library. Importing it registers every op.

Each module holds one op family: schema (``torch.library.custom_op``), fake (meta) impl, argument
checks, the reference as the default kernel for every device, and — where one exists — the Triton
launcher registered as the CUDA kernel.
"""

if __name__ != "dsv4_compile.ops":  # installed from the top-level ops/ folder (STYLE.md, Layout)
    raise ImportError(f"import dsv4_compile.ops, not {__name__!r}")

from . import compressor, indexer, kv_cache, metadata, sparse_attn  # noqa: E402,F401
