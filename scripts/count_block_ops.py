"""Ops dispatched by one transformer block, forward and backward, eager vs fused.

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/count_block_ops.py [--dtype bf16] [--seq 128]

One GPT block (LayerNorm, biases, GeLU, dropout 0.1) and one Llama block (RMSNorm, RoPE, GQA,
SwiGLU, no biases, dropout 0) of width 256, micro-batch 2, on CPU, under ``torch.profiler``.
An op counts when it is the outermost ATen op of its branch of the profiler's tree (an op
dispatched by the model or by autograd: a kernel on a GPU) or an inductor-generated kernel
(``graph_N_cpp_fused_*``, recorded with ``torch._inductor.config.cpp.enable_kernel_profile``); pure
views and allocations (view, reshape, transpose, empty, ...: no kernel on a GPU) are left out
and ops that only dispatch others (linear, matmul, dropout, to, ...) count as what they
dispatch. GEMMs (mm, addmm, bmm, ...)
and attention kernels are also counted apart. The compiled regions are warmed up before
profiling (their compile is not counted).

Megatron-Core's count, by reading its ``TransformerLayer`` with the Transformer Engine spec
(``gpt_layer_specs``: ``TELayerNormColumnParallelLinear`` for QKV and fc1, which run the norm
and the GEMM with the bias in its epilogue, ``TEDotProductAttention`` (flash), a
``TERowParallelLinear`` with ``skip_bias_add``, ``bias_dropout_add`` and ``bias_gelu_impl`` /
``bias_swiglu_impl`` as ``jit_fuser`` kernels, TE's fused RoPE once for q and once for k)
is printed beside ours: forward GPT 10 (4 GEMMs, 2 norms, 1 attention, 2 bias-dropout-add,
1 bias-GeLU), Llama 12 (4 GEMMs (gate and up are one fc1 GEMM), 2 norms, 2 RoPE, 1 attention,
2 residual adds, 1 SwiGLU); backward about 20 each (8 GEMMs, 2 kernels per norm, ~3 per flash
backward, the dropout-mask or RoPE / activation backward per fused op, 2 residual gradient
adds; TE's wgrad GEMM computes the bias gradient in its epilogue).
"""

from __future__ import annotations

import argparse
import collections

import torch

from models.blocks import Block
from models.fusion import KernelFusion, set_kernel_fusion
from models.gpt import GPTConfig

METADATA = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand",
            "as_strided", "unsqueeze", "squeeze", "select", "slice", "split", "chunk", "unbind",
            "narrow", "alias", "detach", "empty", "empty_like", "empty_strided", "resize_",
            "lift_fresh", "view_as", "expand_as", "flatten", "unflatten", "movedim",
            "split_with_sizes", "set_", "resolve_conj", "resolve_neg", "_reshape_alias",
            "new_empty", "new_empty_strided", "detach_", "result_type", "is_same_size",
            "_has_compatible_shallow_copy_type", "record_stream", "_local_scalar_dense"}
"""Views, allocations and metadata: no kernel on a GPU."""
COMPOSITE = {"linear", "matmul", "dropout", "layer_norm", "scaled_dot_product_attention", "to",
             "_to_copy", "contiguous", "type_as", "float", "softmax", "log_softmax",
             "feature_dropout", "native_dropout", "cat", "stack", "rms_norm"}
"""Ops that only dispatch others: their children are counted instead."""
GEMMS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}
MEGATRON = {"gpt": (10, 20), "llama": (12, 20)}
"""Megatron-Core's fused kernels per block (forward, backward), read as the docstring says."""

CONFIGS = {
    "gpt": dict(hidden_size=256, num_attention_heads=4, hidden_dropout=0.1,
                attention_dropout=0.0),
    "llama": dict(hidden_size=256, num_attention_heads=4, num_query_groups=2,
                  normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                  add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0),
}


def _name(event) -> str:
    return event.name.split("::", 1)[-1] if event.name.startswith("aten::") else event.name


def _count_tree(event, counts: collections.Counter) -> None:
    name = _name(event)
    if "cpp_fused" in event.name or (event.name.startswith("aten::")
                                              and name not in METADATA | COMPOSITE):
        counts[name] += 1  # one op dispatched: what it calls inside is its own business
        return
    if event.name.startswith("aten::") and name in METADATA:
        return
    for child in event.cpu_children:
        _count_tree(child, counts)


def _top_level(events) -> collections.Counter:
    """Outermost ATen ops and inductor kernels of the profiler tree (see the module doc)."""
    counts = collections.Counter()
    for e in events:
        if e.cpu_parent is None:
            _count_tree(e, counts)
    return counts


def _profile(fn) -> collections.Counter:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return _top_level(prof.events())


def count(kind: str, fused: bool, dtype: torch.dtype, seq: int) -> dict:
    """``{"forward": Counter, "backward": Counter}`` of one block of ``kind``."""
    cfg = GPTConfig(num_layers=1, vocab_size=128, max_position_embeddings=seq,
                    **CONFIGS[kind])
    torch.manual_seed(0)
    block = Block(cfg, cfg.rotary()).to(dtype)
    set_kernel_fusion(block, KernelFusion.every(fused))
    x = torch.randn(2, seq, cfg.hidden_size, dtype=dtype, requires_grad=True)
    for _ in range(2):  # warm-up: compile, RoPE tables, allocator
        block(x).sum().backward()
    out = {}
    y = None

    def forward():
        nonlocal y
        y = block(x)

    block.zero_grad(set_to_none=True)  # the first gradient is stolen, not accumulated
    x.grad = None
    out["forward"] = _profile(forward)
    grad = torch.ones_like(y)
    out["backward"] = _profile(lambda: y.backward(grad))
    return out


def _summary(counter: collections.Counter) -> str:
    gemm = sum(n for k, n in counter.items() if k in GEMMS)
    attn = sum(n for k, n in counter.items() if "attention" in k)
    return f"{sum(counter.values()):4d} ops ({gemm:2d} GEMM, {attn} attention)"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--verbose", action="store_true", help="print every op's count")
    a = p.parse_args(argv)
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True  # inductor's kernels as profiler events
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    print(f"ops dispatched per block (CPU, {a.dtype}, b=2, s={a.seq}, h=256; top-level ops, "
          "views/allocations left out)")
    for kind in CONFIGS:
        for fused in (False, True):
            c = count(kind, fused, dtype, a.seq)
            label = f"{kind:5s} {'fused' if fused else 'eager'}"
            print(f"{label}  forward {_summary(c['forward'])}  backward "
                  f"{_summary(c['backward'])}")
            if a.verbose:
                for phase in ("forward", "backward"):
                    print(f"    {phase}: {dict(sorted(c[phase].items()))}")
        fwd, bwd = MEGATRON[kind]
        print(f"{kind:5s} Megatron-Core (TE spec, by reading)  forward {fwd:4d}  backward ~{bwd}")


if __name__ == "__main__":
    main()
