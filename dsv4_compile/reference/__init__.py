"""Pure-PyTorch references of every DSV4 operation: the executable specification.

fp32 math, any device, no host synchronisation, no Python branching on tensor values, no Triton.
They are the CPU kernels of the ``dsv4::`` ops and the oracle every Triton kernel is tested against.
One module per op family: ``quant``, ``kv_store``, ``metadata``, ``compressor``, ``indexer``,
``sparse_attn``, ``hyper_connection``, ``experts``; ``functional`` holds the shared RMSNorm / RoPE / Hadamard math.
"""
