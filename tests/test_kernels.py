"""apex is optional: without it nothing changes; with it LayerNorms become fused, names kept."""

import importlib.machinery
import sys
import types

import torch
import torch.nn as nn

from hybrid.parallel.kernels import fused_layer_norm_class, use_fused_kernels
from hybrid.parallel.layers import TPSpec
from models.gpt import GPT, GPTConfig

CFG = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=50,
                max_position_embeddings=8)


def test_without_apex_or_cuda_nothing_changes(monkeypatch):
    monkeypatch.setitem(sys.modules, "apex", None)
    assert fused_layer_norm_class() is None
    model = GPT(CFG)
    assert use_fused_kernels(model, torch.device("cpu")) == 0
    assert use_fused_kernels(model, torch.device("cuda")) == 0


class FakeFused(nn.LayerNorm):  # stands in for apex.normalization.FusedLayerNorm
    pass


def _fake_apex(monkeypatch, extension: bool) -> None:
    apex = types.ModuleType("apex")
    apex.normalization = types.SimpleNamespace(FusedLayerNorm=FakeFused)
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.normalization", apex.normalization)
    ext = types.ModuleType("fused_layer_norm_cuda")
    ext.__spec__ = importlib.machinery.ModuleSpec("fused_layer_norm_cuda", None)
    monkeypatch.setitem(sys.modules, "fused_layer_norm_cuda", ext if extension else None)


def test_apex_without_its_cuda_extension_is_not_used(monkeypatch):
    # apex's Python package alone: FusedLayerNorm() would fail importing fused_layer_norm_cuda
    _fake_apex(monkeypatch, extension=False)
    assert fused_layer_norm_class() is None
    assert use_fused_kernels(GPT(CFG), torch.device("cuda")) == 0


def test_with_apex_layernorms_are_swapped_and_names_kept(monkeypatch):
    _fake_apex(monkeypatch, extension=True)
    model = GPT(CFG)
    model.ln_f.weight.tp_spec = TPSpec(None, (16,), 0, 0, 1)
    names = [n for n, _ in model.named_parameters()]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(nn.Module, "to", lambda self, *a, **k: self)  # no CUDA here
    assert use_fused_kernels(model, torch.device("cuda")) == 3  # ln1, ln2, ln_f
    assert isinstance(model.ln_f, FakeFused) and isinstance(model.layers[0].ln1, FakeFused)
    assert [n for n, _ in model.named_parameters()] == names
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.ln_f.weight.tp_spec.replicated
