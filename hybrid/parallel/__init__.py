"""The 2D process grid and Megatron-style tensor parallelism (arXiv 1909.08053 §3): conjugate
autograd ops, the TP linears (:mod:`hybrid.parallel.linear`: column/row parallel, their rings
and their one GEMM module), the vocab-parallel and sequence-parallel layers, the per-parameter
TP spec, vocab-parallel cross-entropy, the TP plan that swaps a plain GPT's modules, RNG
streams and a local spawn launcher. (Kernel fusion, which is not tensor parallelism, is
:mod:`hybrid.fusion`.)"""
