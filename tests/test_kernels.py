"""apex is optional: without it (or without its loadable CUDA extension) nothing changes; with it
every norm keeps its module, names and arithmetic, the zero-centred ``1 + w`` of
``--apply-layernorm-1p`` and the sequence-parallel wrapper included, and only the kernel under
``fusion.norm`` becomes apex's.

The fake apex here computes with torch's own formulas, so the fp32 outputs must equal the eager
model's to 1e-6 (the kernels differ only in summation order). The CUDA test at the end runs the
real apex when a GPU with apex is lent."""

import importlib.abc
import importlib.machinery
import os
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybrid.fusion import apex_norm_kernels, use_fused_kernels
from hybrid.parallel.layers import SequenceParallelLayerNorm
from models.fusion import KernelFusion, set_kernel_fusion
from models.gpt import GPT, GPTConfig
from models.norms import NormArithmetic, rms_norm

CFG = dict(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=50,
           max_position_embeddings=8, hidden_dropout=0.0, attention_dropout=0.0)
LLAMA = dict(CFG, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
             qk_layernorm=True, add_bias_linear=False, ffn_hidden_size=32)


def test_without_apex_or_cuda_nothing_changes(monkeypatch):
    monkeypatch.setitem(sys.modules, "apex", None)
    assert apex_norm_kernels() is None
    model = GPT(GPTConfig(**CFG))
    assert use_fused_kernels(model, torch.device("cpu")) == 0
    assert use_fused_kernels(model, torch.device("cuda")) == 0
    assert all(m.fused_kernel is None for m in model.modules() if isinstance(m, NormArithmetic))


def _fake_apex(monkeypatch, extension: str = "loads", calls: list | None = None) -> None:
    """A stand-in apex whose functional kernels compute torch's formulas and count calls;
    ``extension``: ``loads``, ``missing`` (the Python package alone) or ``broken`` (found on
    the path, fails to load, as a build for another torch does)."""
    calls = [] if calls is None else calls

    def layer(x, w, b, shape, eps):
        calls.append("layer")
        return F.layer_norm(x, shape, w, b, eps)

    def rms(x, w, shape, eps):
        calls.append("rms")
        return rms_norm(x, w, eps)

    apex = types.ModuleType("apex")
    apex.normalization = types.ModuleType("apex.normalization")
    apex.normalization.fused_layer_norm = types.SimpleNamespace(
        fused_layer_norm_affine=layer, fused_rms_norm_affine=rms)
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.normalization", apex.normalization)
    monkeypatch.delitem(sys.modules, "fused_layer_norm_cuda", raising=False)
    if extension == "loads":
        monkeypatch.setitem(sys.modules, "fused_layer_norm_cuda", types.ModuleType("ext"))
    elif extension == "missing":
        monkeypatch.setitem(sys.modules, "fused_layer_norm_cuda", None)
    else:
        monkeypatch.setattr(sys, "meta_path", [BrokenExtension(), *sys.meta_path])


class BrokenExtension(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``fused_layer_norm_cuda`` and fails to load it (an undefined symbol)."""

    def find_spec(self, name, path=None, target=None):
        if name == "fused_layer_norm_cuda":
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        raise ImportError("fused_layer_norm_cuda.so: undefined symbol: _ZN3c10")

    def exec_module(self, module):
        raise AssertionError("not reached")


@pytest.mark.parametrize("extension", ["missing", "broken"])
def test_apex_without_a_loadable_cuda_extension_is_not_used(monkeypatch, extension):
    _fake_apex(monkeypatch, extension)
    assert apex_norm_kernels() is None
    assert use_fused_kernels(GPT(GPTConfig(**CFG)), torch.device("cuda")) == 0


@pytest.mark.parametrize("kw", [dict(CFG, apply_layernorm_1p=True),
                                dict(LLAMA, apply_layernorm_1p=True), LLAMA],
                         ids=["layernorm-1p", "rmsnorm-1p-qknorm", "rmsnorm-qknorm"])
def test_with_apex_every_norm_keeps_its_arithmetic_and_names(monkeypatch, kw):
    calls = []
    _fake_apex(monkeypatch, "loads", calls)
    torch.manual_seed(0)
    eager = GPT(GPTConfig(**kw))
    with torch.no_grad():  # trained-looking norms: the 1 + w matters
        for n, p in eager.named_parameters():
            if "norm" in n or "ln" in n:
                p.normal_(0.0, 0.1)
    model = GPT(GPTConfig(**kw))
    model.load_state_dict(eager.state_dict())
    names = [n for n, _ in model.named_parameters()]
    set_kernel_fusion(model, KernelFusion(norm=True))
    norms = sum(isinstance(m, NormArithmetic) for m in model.modules())
    assert use_fused_kernels(model, torch.device("cuda")) == norms > 0
    assert [n for n, _ in model.named_parameters()] == names
    x = torch.randint(0, 50, (2, 8))
    torch.testing.assert_close(model(x, x), eager(x, x), rtol=1e-6, atol=1e-6)
    assert len(calls) == norms  # every norm ran apex's kernel, once


def test_the_sequence_parallel_wrapper_runs_the_norms_own_arithmetic(monkeypatch, tmp_path):
    """The wrapper around ``RMSNorm1P`` / ``LayerNorm1P`` gave zeros at init (it scaled by w,
    not 1 + w); it must give what the unwrapped norm gives, eager and with apex's kernel, and
    keep the parameters under their names, once."""
    calls = []
    _fake_apex(monkeypatch, "loads", calls)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        for kw in (dict(CFG, apply_layernorm_1p=True), dict(LLAMA, apply_layernorm_1p=True)):
            model = GPT(GPTConfig(**kw))
            norm = model.layers[0].ln1
            x = torch.randn(2, 8, 16, requires_grad=True)
            want = norm(x)
            assert want.abs().sum() > 0
            wrapped = SequenceParallelLayerNorm(norm, dist.group.WORLD)
            assert [n for n, _ in wrapped.named_parameters()] == [
                n for n, _ in norm.named_parameters()]
            torch.testing.assert_close(wrapped(x), want, rtol=0, atol=0)
            set_kernel_fusion(wrapped, KernelFusion(norm=True))
            assert use_fused_kernels(wrapped, torch.device("cuda")) == 1
            torch.testing.assert_close(wrapped(x), want, rtol=1e-6, atol=1e-6)
        assert calls == ["layer", "rms"]
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_apex_on_cuda_keeps_one_plus_w_plain_and_sequence_parallel(tmp_path):
    """With apex's CUDA norms: a 1p model fused with apex equals its eager self (fp32, 1e-5: a
    different summation order), and the sequence-parallel wrapper (a one-rank group) equals the
    plain norm."""
    if apex_norm_kernels() is None:
        pytest.skip("apex with its CUDA extension is not installed")
    dev = torch.device("cuda")
    for kw in (dict(CFG, apply_layernorm_1p=True), dict(LLAMA, apply_layernorm_1p=True)):
        torch.manual_seed(0)
        eager = GPT(GPTConfig(**kw)).to(dev)
        fused = GPT(GPTConfig(**kw)).to(dev)
        fused.load_state_dict(eager.state_dict())
        set_kernel_fusion(fused, KernelFusion(norm=True))
        assert use_fused_kernels(fused, dev) > 0
        x = torch.randint(0, 50, (2, 8), device=dev)
        torch.testing.assert_close(fused(x, x), eager(x, x), rtol=1e-5, atol=1e-5)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        norm = GPT(GPTConfig(**dict(LLAMA, apply_layernorm_1p=True))).layers[0].ln1.to(dev)
        x = torch.randn(2, 8, 16, device=dev)
        want = norm(x)
        wrapped = SequenceParallelLayerNorm(norm, dist.group.WORLD)
        set_kernel_fusion(wrapped, KernelFusion(norm=True))
        assert use_fused_kernels(wrapped, dev) == 1
        torch.testing.assert_close(wrapped(x), want, rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()
