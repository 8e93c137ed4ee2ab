"""Triton / Gluon kernels and their launchers (``launch_*``); no torch.library code here.
Launchers take torch tensors and also run on CPU tensors under ``TRITON_INTERPRET=1``.

* ``host``: launcher helpers (interpreter flag, PDL capability, SM count, unit strides).
* ``primitives``: Triton pieces shared by the kernels (MODEL1 layout constexprs and key gather /
  dequantisation, fp8 / bf16 bits, Hadamard matrix, online softmax and row epilogue).
* ``kv_cache``: MODEL1 and indexer-key cache writes and reads.
* ``compressor``: ``compress_kv`` (window pooling, then the entry and the state-ring write).
* ``indexer``, ``topk_select``: ``indexer_prepare_q``; ``indexer_topk`` as logits scan + select.
* ``metadata``: the per-step metadata ops.
* ``hyper_connection``: ``sinkhorn`` (the mHC comb weights' Sinkhorn-Knopp normalisation).
* sparse attention: ``sparse_attn_dispatch`` (tiling, path choice, launch) over the kernel
  families ``sparse_attn_fused``, ``sparse_attn_two_pass``, ``sparse_attn_warp_specialized``
  (Gluon, sm_90) and ``sparse_attn_combine`` (split combine; the partial buffers' layout), with
  their shared argument packing in ``sparse_attn_args``; ``flashmla`` wraps FlashMLA.
"""
