"""Fused elementwise kernels (``models.fusion``, ``--kernel-fusion``): the flags, each compiled
region against the eager op it replaces, the whole model fused against eager, the dropout masks
replayed (same generator state, TP stream, activation recompute), and a tp = 2 world (with and
without sequence parallelism) against the single-process fused model.

Tolerances: fp32, 1e-5 absolute and relative on losses and gradients, the grids' own parity
tolerance (``tests/test_tp.py``): a compiled kernel reorders the same fp32 sums (observed
<= 1e-7 on the tiny model). With dropout the fused and eager models draw different masks
(``models.fusion``'s docstring), so dropout cases compare fused with fused.
"""

import pytest
import torch
import torch.nn.functional as F

from hybrid.config import PretrainConfig
from hybrid.config_fields import ConfigError
from hybrid.fusion import FusionConfig
from hybrid.job.cli import parse_config
from hybrid.parallel.rng import RNGTracker
from hybrid.parallel.spawn import spawn_world
from models import fusion
from models.blocks import bias_dropout_add
from models.fusion import OFF, KernelFusion, set_kernel_fusion
from models.gpt import GPT, GPTConfig
from models.rope import apply_rotary
from tests.fusion_worlds import CASES, GPT_KW, LLAMA_KW, fusion_world, run_single

TOL = dict(rtol=1e-5, atol=1e-5)


def test_default_is_eager_everywhere_and_fused_on_cuda():
    cfg = FusionConfig()
    assert cfg.resolve("cpu") == OFF
    assert cfg.resolve("cuda") == KernelFusion.every()
    assert FusionConfig(kernel_fusion="off").resolve("cuda") == OFF
    on = FusionConfig(kernel_fusion="on", bias_dropout_fusion=False).resolve("cpu")
    assert on.norm and on.rope and not on.bias_dropout
    model = GPT(GPTConfig(**GPT_KW))
    assert all(m.fusion == OFF for m in model.modules() if hasattr(m, "fusion"))


def test_megatron_flags_parse():
    argv = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2",
            "--mock-data", "--vocab-size", "64", "--no-bias-gelu-fusion",
            "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion", "--no-rope-fusion",
            "--kernel-fusion", "on"]
    cfg = parse_config(argv)
    assert isinstance(cfg, PretrainConfig)
    assert cfg.fusion.resolve("cpu") == KernelFusion(norm=True)
    assert parse_config(argv[:9]).fusion == FusionConfig()
    with pytest.raises(ConfigError, match="--kernel-fusion: invalid choice: 'fast'"):
        parse_config([*argv[:-1], "fast"])


def _grads(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(out, [torch.ones_like(o) for o in out])
    return out, [t.grad for t in inputs if t.is_floating_point()]


def test_each_compiled_region_matches_the_eager_op():
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(2, 8, 32, generator=g), torch.randn(2, 8, 32, generator=g)
    w, b = torch.randn(32, generator=g), torch.randn(32, generator=g)
    q, k = torch.randn(2, 4, 8, 16, generator=g), torch.randn(2, 2, 8, 16, generator=g)
    cos, sin = torch.randn(8, 12, generator=g), torch.randn(8, 12, generator=g)
    pairs = [
        (lambda x, w: fusion.rms_norm(x, w, 1e-5),
         lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w, (x, w)),
        (lambda x, w, b: fusion.layer_norm(x, w, b, 1e-5),
         lambda x, w, b: F.layer_norm(x, (32,), w, b, 1e-5), (x, w, b)),
        (fusion.bias_gelu, lambda y, b: F.gelu(y + b), (x, b)),
        (lambda g_, gb, u, ub: fusion.bias_swiglu(g_, gb, u, ub),
         lambda g_, gb, u, ub: F.silu(g_ + gb) * (u + ub), (x, b, res, w)),
        (lambda y, b, r: fusion.bias_dropout_add(y, b, r, 0.1, False),
         lambda y, b, r: r + (y + b), (x, b, res)),
        (lambda q, k, c, s: fusion.rope(q, k, c, s, False),
         lambda q, k, c, s: (apply_rotary(q, c, s, False), apply_rotary(k, c, s, False)),
         (q, k, cos, sin)),
        (lambda q, k, c, s: fusion.rope(q, k, c, s, True),
         lambda q, k, c, s: (apply_rotary(q, c, s, True), apply_rotary(k, c, s, True)),
         (q, k, cos, sin)),
    ]
    for fused, eager, inputs in pairs:
        (out_f, grads_f), (out_e, grads_e) = _grads(fused, *inputs), _grads(eager, *inputs)
        for a, e in zip(out_f + tuple(grads_f), out_e + tuple(grads_e), strict=True):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_no_graph_breaks():
    x, w, b = torch.randn(2, 4, 8), torch.randn(8), torch.randn(8)
    for fn, args in ((fusion._rms_norm, (x, w, 1e-5)), (fusion._layer_norm, (x, w, b, 1e-5)),
                     (fusion._bias_gelu, (x, b)), (fusion._bias_swiglu, (x, b, x, w)),
                     (fusion._bias_dropout_add, (x, b, x, 0.1, True))):
        explained = torch._dynamo.explain(fn)(*args)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, fn.__name__


@pytest.mark.parametrize("kw", [GPT_KW, LLAMA_KW], ids=["gpt", "llama"])
def test_fused_model_matches_eager(kw):
    fused, eager = run_single(kw, True), run_single(kw, False)
    assert fused["loss"] == pytest.approx(eager["loss"], abs=1e-5)
    for name, g in eager["grads"].items():
        torch.testing.assert_close(fused["grads"][name], g, **TOL, msg=name)


def test_dropout_masks_replay_from_the_generator_and_the_tp_stream():
    x, res = torch.randn(4, 8, 32), torch.randn(4, 8, 32)
    drop = torch.nn.Dropout(0.5)
    state = torch.get_rng_state()
    first = bias_dropout_add(x, None, drop, res)
    torch.set_rng_state(state)
    assert torch.equal(bias_dropout_add(x, None, drop, res), first)  # same state, same mask
    assert not torch.equal(bias_dropout_add(x, None, drop, res), first)  # the state moved on
    from hybrid.parallel.layers import TPRegionDropout

    tracker = RNGTracker(5, tp_rank=1)
    tp_drop = TPRegionDropout(0.5, tracker)
    saved, outer = tracker.get_state(), torch.get_rng_state()
    a = bias_dropout_add(x, None, tp_drop, res)
    assert torch.equal(torch.get_rng_state(), outer)  # drawn from the TP stream only
    tracker.set_state(saved)
    assert torch.equal(bias_dropout_add(x, None, tp_drop, res), a)
    other = RNGTracker(5, tp_rank=0)
    assert not torch.equal(bias_dropout_add(x, None, TPRegionDropout(0.5, other), res), a)


def test_a_mask_recording_dropout_still_sees_the_tensor():
    seen = []

    class Recorder(torch.nn.Dropout):
        def forward(self, t):
            seen.append(t)
            return t

    y, b, res = torch.randn(2, 3, 4), torch.randn(4), torch.randn(2, 3, 4)
    out = bias_dropout_add(y, b, Recorder(0.1), res)
    torch.testing.assert_close(seen[0], y + b)
    torch.testing.assert_close(out, res + y + b)


def test_set_kernel_fusion_reaches_every_fusable_module():
    model = GPT(GPTConfig(**LLAMA_KW))
    n = set_kernel_fusion(model, KernelFusion.every())
    # per block: ln1, ln2, attention, MLP, the block; plus ln_f
    assert n == 5 * LLAMA_KW["num_layers"] + 1


def test_the_start_up_line_names_only_the_fusions_the_model_has():
    """Every chain asked for; a GPT runs no SwiGLU and no RoPE, a Llama no bias-GeLU."""
    from hybrid.fusion import apply_kernel_fusion

    every = KernelFusion.every()
    gpt = apply_kernel_fusion(GPT(GPTConfig(**GPT_KW)), every, torch.device("cpu"))
    assert gpt == "kernel fusion: norm, bias_gelu, bias_dropout (torch.compile; norms compiled)"
    llama = apply_kernel_fusion(GPT(GPTConfig(**LLAMA_KW)), every, torch.device("cpu"))
    assert llama == ("kernel fusion: norm, bias_swiglu, bias_dropout, rope (torch.compile; "
                     "norms compiled)")
    no_rope = apply_kernel_fusion(GPT(GPTConfig(**LLAMA_KW)), KernelFusion(
        norm=True, bias_swiglu=True), torch.device("cpu"))
    assert no_rope == "kernel fusion: norm, bias_swiglu (torch.compile; norms compiled)"
    assert apply_kernel_fusion(GPT(GPTConfig(**GPT_KW)), OFF, torch.device("cpu")) == (
        "kernel fusion: off (eager elementwise ops)")


@pytest.fixture(scope="module")
def world():
    return spawn_world(2, fusion_world, timeout_s=120)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", [c for c in CASES if not c.endswith("recompute")])
def test_tp2_fused_matches_single_process(world, case):
    kw, sp, _ = CASES[case]
    if sp and (kw["hidden_dropout"] or kw["attention_dropout"]):
        pytest.skip("SP draws its dropout masks from the TP streams: compared with recompute")
    ref = run_single(kw, True)
    for rank_out in world:
        got = rank_out[case]
        assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        for name, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, **TOL, msg=name)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_recompute_replays_the_fused_dropout_masks_under_sp(world):
    # the TP streams and the default generator are restored before a checkpointed block runs
    # again: the fused bias-dropout-add and attention draw the same masks, bit for bit
    for rank_out in world:
        plain, again = rank_out["gpt_tp2_sp_dropout"], rank_out["gpt_tp2_sp_dropout_recompute"]
        assert again["loss"] == plain["loss"]
        for name, g in plain["grads"].items():
            assert torch.equal(again["grads"][name], g), name
