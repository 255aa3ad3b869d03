"""CPU-offloaded activation checkpoints (P_a+cpu) through :mod:`hybrid.activation.offload`:
pinned host buffers reused from a pool, the next checkpoint prefetched during a recompute, and
on CUDA every copy on a side stream ordered by events. The CUDA branch runs here on CPU tensors
with a recording stand-in for streams and events."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from hybrid.activation.offload import HostOffload
from hybrid.activation.recompute import ActivationStore, CheckpointedForward
from models.gpt import GPT, GPTConfig

CFG = GPTConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=64,
                max_position_embeddings=16, hidden_dropout=0.1, attention_dropout=0.1)


def _grads(model, batches):
    torch.manual_seed(7)
    for x in batches:
        model(x[:, :-1], x[:, 1:]).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_offloaded_checkpoints_reuse_host_buffers_prefetch_and_give_the_same_grads(monkeypatch):
    """3 checkpointed blocks, 2 micro-batches, dropout 0.1: the gradients are those of the
    unwrapped model bit for bit; host buffers are allocated for the first micro-batch only
    (before: one fresh, pinned on CUDA, per checkpoint per micro-batch); loading block i's
    checkpoint prefetches block i-1's."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = GPT(CFG)
    model.load_state_dict(ref.state_dict())
    store = ActivationStore(None, partition=True, in_cpu=True, num_slots=None, tracker=None)
    for i, block in enumerate(model.layers):
        block.forward = CheckpointedForward(block, i, store)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 17), generator=g) for _ in range(2)]
    want, got = _grads(ref, batches), _grads(model, batches)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert store.stats.checkpoints == 6 and store.stats.recomputes == 6
    assert store.offload.allocations == store.stats.standalone_allocations == 3
    assert store.offload.prefetches == 4  # blocks 1 and 0 of each micro-batch
    assert sum(len(v) for v in store.offload.pool.values()) == 3  # all back in the pool


class _Event:
    def __init__(self, log, stream):
        self.log, self.stream = log, stream


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def record_event(self):
        self.log.append(f"{self.name}: record")
        return _Event(self.log, self)

    def wait_event(self, event):
        self.log.append(f"{self.name}: wait {event.stream.name}")


def test_the_cuda_branch_copies_on_a_side_stream_ordered_by_events(monkeypatch):
    log: list[str] = []
    compute, side = _Stream("compute", log), _Stream("side", log)
    current = [compute]

    @contextlib.contextmanager
    def stream(s):
        current.append(s)
        yield
        current.pop()

    copy_ = torch.Tensor.copy_

    def logged_copy(self, src, non_blocking=False):
        log.append(f"{current[-1].name}: copy non_blocking={non_blocking}")
        return copy_(self, src)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.Tensor, "copy_", logged_copy)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, s: log.append(f"record_stream {s.name}"))
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: (
        log.append(f"{current[-1].name}: to non_blocking={k.get('non_blocking')}"), self)[1])
    off = HostOffload(torch.device("cpu"))
    off.cuda, off.stream = True, side  # the CUDA branch, on CPU tensors
    src = torch.arange(6.0)
    host = torch.empty(6)
    done = off.to_host(host, src)
    assert torch.equal(host, src)
    assert log == ["compute: record", "side: wait compute", "side: copy non_blocking=True",
                   "record_stream side", "side: record"]
    log.clear()
    handle = off.start_to_device(host, done)
    back = off.finish_to_device(handle)
    assert back is host
    assert log == ["side: wait side", "side: to non_blocking=True", "side: record",
                   "compute: wait side", "record_stream compute"]


def test_host_buffers_are_pooled_by_size_and_dtype():
    off = HostOffload(torch.device("cpu"))
    a = off.host_buffer(10, torch.float32)
    off.give_back(a)
    assert off.host_buffer(10, torch.float32) is a
    assert off.host_buffer(10, torch.bfloat16) is not a and off.allocations == 2
    with pytest.raises(AttributeError):
        off.stream.synchronize()  # no stream on CPU
