"""Parameter counts, FLOPs per iteration, MFU/HFU and training-time arithmetic for GPT.

Everything here is pure integer/float arithmetic (no torch import except in ``device_peak_tflops``
when it is asked to look at the current device). Units are in every name or docstring:
FLOPs are floating-point operations (a multiply-add is 2), TFLOP/s is 1e12 FLOP/s.

Sources:
- Parameters: Narayanan et al. 2021 (arXiv 2104.04473) §5.1 Eq. 2, P = 12lh^2 + 13lh + (V+s)h,
  generalised here to an MLP of width f and an optional untied output matrix, plus the final
  LayerNorm (2h) that the paper leaves out.
- FLOPs: 2104.04473 Eq. 3 and Appendix (full recompute, "96"), Korthikanti et al. 2022
  (arXiv 2205.05198) Appendix A Eq. 7 (model FLOPs, "72") and Eq. 8 (selective recompute).
- Training time: 2104.04473 Eq. 4. Vocabulary padding: Shoeybi et al. 2019 (arXiv 1909.08053) §5.1.
"""

from __future__ import annotations

from hybrid.parallel.tp_split import tp_split_refusal
from models.config import GPTConfig

RECOMPUTE_MODES = ("none", "selective", "full")
"""Activation recomputation modes understood by ``flops_per_iteration``."""

# (substring of torch.cuda.get_device_name(), dense bf16/fp16 tensor-core peak in TFLOP/s).
# Checked in order, case-insensitively, so the more specific names come first
# ("GH200" contains "H200", "H100 PCIe" contains "H100"). Vendor datasheets, dense (no sparsity).
DEVICE_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("V100S", 130.0),
    ("V100-PCIE", 112.0),
    ("V100", 125.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM5
    ("H800", 989.0),
    ("GH200", 989.0),
    ("H200", 989.0),
)


# ----------------------------------------------------------------------------- parameters


def layer_parameter_split(model: GPTConfig) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one layer, in elements
    (:meth:`GPTConfig.layer_parameter_split`)."""
    return model.layer_parameter_split()


def parameter_split(model: GPTConfig, final_layernorm: bool = True) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of the model (:meth:`GPTConfig.parameter_split`);
    ``sharded + replicated == num_parameters(model)``."""
    return model.parameter_split(final_layernorm)


def num_parameters(model: GPTConfig, final_layernorm: bool = True) -> int:
    """Total parameters P (elements) of ``model`` (:meth:`GPTConfig.num_parameters`).

    With f = 4h, tied output and the final LayerNorm:
    P = 12lh^2 + 13lh + (V + s)h + 2h (2104.04473 Eq. 2 plus 2h). GPT-2 small gives 124,439,808.
    """
    return model.num_parameters(final_layernorm)


def parameters_per_tp_rank(model: GPTConfig, tp: int) -> int:
    """Parameters held by one tensor-parallel rank, in elements: sharded/tp + replicated.

    Raises ValueError when tp does not divide the heads, f or the vocabulary (pad it first).
    """
    m = model
    if tp <= 0:
        raise ValueError(f"tp must be positive, got {tp}")
    if (refusal := tp_split_refusal(m, tp, vocab_size=m.vocab_size)) is not None:
        raise ValueError(str(refusal))
    sharded, replicated = parameter_split(m)
    return sharded // tp + replicated


# ----------------------------------------------------------------------------- FLOPs


def flops_per_iteration(
    model: GPTConfig, batch_size: int, seq_length: int, recompute: str = "none"
) -> int:
    """Matmul FLOPs of one forward+backward over ``batch_size`` sequences of ``seq_length`` tokens.

    Per layer forward: QKV + projection + MLP GEMMs 2Bs(4h^2 + 2hf) (= 24Bsh^2 at f = 4h) and
    attention scores + attention over V 4Bs^2h; logit layer 2BshV. Backward costs 2x forward.
    - ``"none"``: model FLOPs, 3 passes = 72BLsh^2(1 + s/6h + V/12hL) (2205.05198 Eq. 7).
    - ``"full"``: one extra layer forward = 96BLsh^2(1 + s/6h + V/16Lh) (2104.04473 Eq. 3);
      the logit layer is not recomputed.
    - ``"selective"``: 72BLsh^2(1 + s/3h + V/12hL) (2205.05198 Eq. 8: the paper's accounting
      doubles the attention term, so we follow it to reproduce its HFU).
    GEMMs only; LayerNorm, softmax and biases are ignored, as in both papers.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if batch_size <= 0 or seq_length <= 0:
        raise ValueError(
            f"batch_size and seq_length must be positive, got {batch_size}, {seq_length}"
        )
    m = model
    b, s, h, f = batch_size, seq_length, m.hidden_size, m.ffn_hidden_size
    gemm = 2 * b * s * (4 * h * h + 2 * h * f) * m.num_layers
    attention = 4 * b * s * s * h * m.num_layers
    logits = 2 * b * s * h * m.vocab_size
    if recompute == "none":
        return 3 * (gemm + attention + logits)
    if recompute == "full":
        return 4 * (gemm + attention) + 3 * logits
    return 3 * gemm + 6 * attention + 3 * logits


def megatron_flops_per_iteration(model: GPTConfig, batch_size: int, seq_length: int,
                                 padded_vocab_size: int | None = None) -> float:
    """Model FLOPs of one iteration over ``batch_size`` sequences of ``seq_length`` tokens, as
    Megatron-LM's throughput log counts them (its ``num_floating_point_operations``, dense
    GPT): GEMMs only, forward + backward = 3 x forward, a multiply-add = 2 FLOPs.

    Per token: ``6 h (f x (3 if SwiGLU else 2)) L`` for the MLP, ``6 (h (q + 2k) + q h) L`` for
    the QKV and output projections (``q = kv_channels x heads``, ``k = kv_channels x
    query groups``), ``6 h V`` for the logits over the *padded* vocabulary ``V``; plus
    ``6 q s L`` per token of core attention (``QK^T`` and ``softmax V``, halved for the causal
    mask). For GPT-2 shapes this is 2205.05198 Eq. 7 with the attention term halved.

    Raises:
        ValueError: a non-positive batch size or sequence length.
    """
    if batch_size <= 0 or seq_length <= 0:
        raise ValueError(
            f"batch_size and seq_length must be positive, got {batch_size}, {seq_length}"
        )
    m = model
    h, a, L = m.hidden_size, m.num_attention_heads, m.num_layers
    kv = m.kv_channels or h // a
    q, k = kv * a, kv * (m.num_query_groups or a)
    vocab = padded_vocab_size or m.vocab_size
    tokens = batch_size * seq_length
    mlp = 6 * h * m.ffn_hidden_size * (3 if m.swiglu else 2) * L
    projections = 6 * (h * (q + 2 * k) + q * h) * L
    logits = 6 * h * vocab
    core = 6 * q * seq_length * L  # 3 x 2 x q / 2 (causal) x 2 (two matmuls), per token
    return float(tokens * (mlp + projections + logits + core))


def flops_per_token(model: GPTConfig, seq_length: int, recompute: str = "none") -> float:
    """FLOPs per trained token (forward + backward), ``flops_per_iteration(B=1) / seq_length``."""
    return flops_per_iteration(model, 1, seq_length, recompute) / seq_length


def tflops_per_device(flops_per_step: float, step_time_s: float, num_devices: int) -> float:
    """Achieved TFLOP/s per device: flops_per_step / (step_time_s * num_devices) / 1e12."""
    if step_time_s <= 0 or num_devices <= 0:
        raise ValueError(
            f"step_time_s and num_devices must be positive, got {step_time_s}, {num_devices}"
        )
    return flops_per_step / (step_time_s * num_devices) / 1e12


def tflops_per_device_from_tokens(
    model: GPTConfig, tokens_per_s: float, seq_length: int, num_devices: int,
    recompute: str = "none",
) -> float:
    """TFLOP/s per device from the training loop's tokens/s (whole job, all devices together).

    ``recompute="none"`` gives the model TFLOP/s (for MFU), the run's own mode gives hardware
    TFLOP/s (for HFU).
    """
    return tflops_per_device(
        tokens_per_s * flops_per_token(model, seq_length, recompute), 1.0, num_devices
    )


def utilization(
    flops_per_step: float, step_time_s: float, num_devices: int, peak_tflops: float
) -> float:
    """Fraction of peak: flops / (time * devices * peak) (2205.05198 Appendix A).

    Pass model FLOPs (``recompute="none"``) for MFU, the FLOPs actually executed for HFU.
    """
    if peak_tflops <= 0:
        raise ValueError(f"peak_tflops must be positive, got {peak_tflops}")
    return tflops_per_device(flops_per_step, step_time_s, num_devices) / peak_tflops


def mfu(
    model: GPTConfig,
    batch_size: int,
    seq_length: int,
    step_time_s: float,
    num_devices: int,
    peak_tflops: float,
) -> float:
    """Model FLOPs utilisation of one step (fraction, 2205.05198 Eq. 7 over the peak)."""
    flops = flops_per_iteration(model, batch_size, seq_length, "none")
    return utilization(flops, step_time_s, num_devices, peak_tflops)


def hfu(
    model: GPTConfig,
    batch_size: int,
    seq_length: int,
    step_time_s: float,
    num_devices: int,
    peak_tflops: float,
    recompute: str,
) -> float:
    """Hardware FLOPs utilisation: like ``mfu`` but counting the recomputed forward work."""
    flops = flops_per_iteration(model, batch_size, seq_length, recompute)
    return utilization(flops, step_time_s, num_devices, peak_tflops)


def training_time_s(
    tokens: float,
    num_params: float,
    num_devices: int,
    tflops_per_device_achieved: float,
    flops_per_param_token: int = 8,
) -> float:
    """End-to-end training time estimate in seconds: k T P / (n X) (2104.04473 Eq. 4).

    k = 8 assumes full recomputation (2 FLOPs per parameter per token for each of 4 passes);
    use 6 without recompute. GPT-3 (T = 300e9, P = 175e9, n = 1024, X = 140 TF) gives 33.9 days.
    """
    if num_devices <= 0 or tflops_per_device_achieved <= 0:
        raise ValueError("num_devices and tflops_per_device_achieved must be positive")
    return (
        flops_per_param_token
        * tokens
        * num_params
        / (num_devices * tflops_per_device_achieved * 1e12)
    )


# ----------------------------------------------------------------------------- devices


def device_peak_tflops(device_name: str | None = None) -> float | None:
    """Dense bf16/fp16 tensor-core peak of a device in TFLOP/s, or None when unknown.

    ``device_name`` is matched (case-insensitive substring) against ``DEVICE_PEAK_TFLOPS``;
    None means the current CUDA device (``torch.cuda.get_device_name()``), and a machine without
    CUDA (CPU) gives None. fp32 runs are still measured against this bf16 peak.
    """
    if device_name is None:
        import torch  # lazy: the rest of this module is pure arithmetic

        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    lowered = device_name.lower()
    for key, peak in DEVICE_PEAK_TFLOPS:
        if key.lower() in lowered:
            return peak
    return None
