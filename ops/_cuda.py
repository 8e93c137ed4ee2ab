"""``cuda_kernel`` and ``HAS_TRITON`` under their former module name; both live in ``_library.py``
(``ops/metadata.py`` still imports them from here)."""

from ._library import HAS_TRITON, cuda_kernel  # noqa: F401
