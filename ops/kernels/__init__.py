"""Triton kernels and their launchers (``launch_*``), one module per op family; no torch.library
code here. Launchers take torch tensors and also run on CPU tensors under ``TRITON_INTERPRET=1``.
"""
