"""The CUDA path's choices, checked on CPU (issue 25): which code path a CUDA device takes, how
many kernels or host reads it costs, and that the CPU path keeps its bits. Each test carries the
case that failed before its fix."""

from __future__ import annotations

import math

import pytest
import torch


def test_grad_norm_on_cuda_is_one_multi_tensor_launch(monkeypatch):
    """CUDA: one ``_foreach_norm`` over every gradient fragment instead of one ``vector_norm``
    per 1M-element chunk (~5,900 launches per step at 1.5B); CPU keeps the chunked path."""
    from hybrid.zero import grad_norm

    g = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (3000, 77, 0, 5)]
    calls = {"foreach": 0, "vector_norm": 0}
    foreach, vector_norm = torch._foreach_norm, torch.linalg.vector_norm

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(torch, "_foreach_norm", count("foreach", foreach))
    monkeypatch.setattr(torch.linalg, "vector_norm", count("vector_norm", vector_norm))
    monkeypatch.setattr(grad_norm, "NORM_CHUNK_ELEMENTS", 1000)
    cpu = grad_norm._sum_of_squares(g, torch.device("cpu"))
    assert calls == {"foreach": 0, "vector_norm": 5}  # 3 chunks + 1 + 1
    # the tensors are CPU ones; the device says which path a CUDA rank takes
    cuda = grad_norm._sum_of_squares(g, torch.device("cuda"))
    assert calls == {"foreach": 1, "vector_norm": 5}
    assert cuda.item() == pytest.approx(cpu.item(), rel=1e-13)  # float64 sums, another order
    g[1][3] = float("inf")
    assert not math.isfinite(grad_norm._sum_of_squares(g, torch.device("cuda")).item())
    assert grad_norm._sum_of_squares([], torch.device("cpu")).item() == 0.0


def test_the_stop_request_rides_on_the_grad_norm_all_reduce(monkeypatch):
    """A stop request (SIGTERM, time limit) is carried by the step's grad-norm all-reduce: no
    extra all-reduce and host read per iteration. The norm's bits and the overflow flag are
    unchanged; another rank's request or overflow arrives through the sum."""
    import torch.distributed as dist

    from hybrid.job.preemption import StopSignal
    from hybrid.zero import grad_norm

    g = [torch.randn(100, generator=torch.Generator().manual_seed(0))]
    alone = grad_norm.global_grad_norm(g, [])
    reduces = []
    other = torch.zeros(2, dtype=torch.float64)  # what the other rank contributes

    def all_reduce(t, op=None, group=None):
        reduces.append(t.numel())
        if t.numel() == 2:
            t += other

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    assert grad_norm.global_grad_norm_and_stop(g, [], stop=True) == (*alone, True)
    assert grad_norm.global_grad_norm_and_stop(g, [], stop=False) == (*alone, False)
    other[1] = grad_norm.STOP_UNIT  # the other rank got SIGTERM
    assert grad_norm.global_grad_norm_and_stop(g, [])[1:] == (False, True)
    other[1] = 1.0  # the other rank overflowed
    assert grad_norm.global_grad_norm_and_stop(g, [], stop=True)[1:] == (True, True)
    assert grad_norm.global_grad_norm_and_stop(g, [])[1:] == (True, False)
    reduces.clear()
    stop = StopSignal(None, signals=())
    assert not stop.should_stop("cpu", reduced=False) and stop.should_stop("cpu", reduced=True)
    assert reduces == []  # the step's all-reduce already told every rank
    assert not stop.should_stop("cpu") and reduces == [1]  # no step this iteration (NaN loss)
    stop.received = 15
    assert stop.requested()


def _stub_comm(dp: int, rank: int):
    """A DPComm of ``dp`` ranks that communicates nothing (the benchmark's compute-only floor)."""
    from hybrid.zero.comm import DPComm

    comm = object.__new__(DPComm)
    comm.group, comm.size, comm.rank, comm.composed = None, dp, rank, False
    comm.skip_collectives, comm.bytes = True, __import__("collections").defaultdict(float)
    comm.inter_node, comm.quantized = False, None  # no qgZ (given at construction)
    comm.node_bytes = {k: __import__("collections").defaultdict(float)
                       for k in ("intra_node", "inter_node")}
    return comm


@pytest.mark.parametrize("stage", [1, 2])
def test_bucket_staging_is_one_foreach_copy_per_bucket(monkeypatch, stage):
    """Stage 2 copies each bucket's gradient pieces into the staging buffer with one
    ``_foreach_copy_`` (and stage 1 out of it likewise), not one ``copy_`` per piece; the staged
    values are the per-piece copies' (the partition equals a plain copy of the gradients)."""
    from hybrid.zero.config import ZeroConfig
    from hybrid.zero.layout import PartitionLayout
    from hybrid.zero.reduce import GradReducer
    from models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=64,
                          max_position_embeddings=8, hidden_dropout=0.0, attention_dropout=0.0))
    params = [p for _, p in model.named_parameters()]
    plan = ZeroConfig(stage=stage, param_persistence_threshold=0).plan
    layout = PartitionLayout.from_model(model, 2, 0, 8)
    reducer = GradReducer(params, layout, plan, _stub_comm(2, 0), 4_000, overlap=True)
    calls = {"foreach": 0, "copy_": 0}
    foreach, copy_ = torch._foreach_copy_, torch.Tensor.copy_

    def counted_foreach(*a, **k):
        calls["foreach"] += 1
        return foreach(*a, **k)

    def counted_copy(self, *a, **k):
        calls["copy_"] += 1
        return copy_(self, *a, **k)

    x = torch.randint(0, 64, (2, 8))
    reducer.begin_backward(True)
    monkeypatch.setattr(torch, "_foreach_copy_", counted_foreach)
    monkeypatch.setattr(torch.Tensor, "copy_", counted_copy)
    model(x, x).mean().backward()
    reducer.end_backward()
    monkeypatch.undo()
    staged = sum(1 for b in reducer.buckets if b.copy_in)
    assert calls["copy_"] == len(reducer.buckets)  # the stub's reduce-scatter: one per bucket
    assert calls["foreach"] == staged * (1 if stage == 2 else 2) and staged > 1
    ref = GPT(model.config)
    ref.load_state_dict(model.state_dict())
    ref(x, x).mean().backward()
    grads = [p.grad.reshape(-1) for p in ref.parameters()]
    frags = layout.fragments(0)
    got = torch.cat([reducer.grad_view(f) for f in frags])
    want = torch.cat([grads[f.slot][f.param_start:f.param_start + f.length] for f in frags])
    assert got.numel() > 0 and torch.equal(got, want / 2)  # the floor: this rank's half


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_loader_batches_are_pinned_on_cuda_only(monkeypatch, device):
    """Pageable batches made train_step's ``non_blocking`` host-to-device copy synchronous."""
    from types import SimpleNamespace

    import data.loader
    from hybrid.job import datasets

    got = {}

    def loader(*args, **kwargs):
        got.update(kwargs)
        return [torch.zeros(2, 5, dtype=torch.long)]

    monkeypatch.setattr(data.loader, "build_data_loader", loader)
    job = SimpleNamespace(cfg=SimpleNamespace(training=SimpleNamespace(micro_batch_size=2),
                                              data=SimpleNamespace(
                                                  data_path=None, reset_position_ids=False,
                                                  reset_attention_mask=False,
                                                  eod_mask_loss=False)),
                          gpt=SimpleNamespace(vocab_size=10))
    grid = SimpleNamespace(device=torch.device(device), dp_rank=0, dp_size=1)
    assert len(list(datasets.micro_batches(range(4), 0, job, grid))) == 1
    assert got.get("pin_memory", False) == (device == "cuda")


def test_rng_tracker_seeds_the_device_it_reads(monkeypatch):
    """The tracker read ``cuda:1``'s state but seeded the current device (``cuda:0`` when
    ``set_device`` was not called), so its stream was cuda:1's unseeded state."""
    import contextlib

    from hybrid.parallel import rng

    states = {0: "unseeded 0", 1: "unseeded 1"}
    current = [0]

    @contextlib.contextmanager
    def device(d):
        before, current[0] = current[0], torch.device(d).index
        yield
        current[0] = before

    def manual_seed(seed):
        states[current[0]] = f"seed {seed}"

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "manual_seed", manual_seed)
    monkeypatch.setattr(rng, "_get_state", lambda d: states[d.index])
    monkeypatch.setattr(rng, "_set_state", lambda s, d: states.__setitem__(d.index, s))
    tracker = rng.RNGTracker(seed=5, tp_rank=1, device="cuda:1")
    assert tracker._state == f"seed {5 + rng.TP_SEED_OFFSET + 1}"
    assert states == {0: "unseeded 0", 1: "unseeded 1"}  # the device's own stream is restored


def test_memory_is_per_log_interval_with_reserved_on_cuda(monkeypatch):
    from hybrid import metrics

    peaks = dict(allocated=3 * 2**20, reserved=8 * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: peaks["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: peaks["reserved"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda d: peaks.update(allocated=2**20, reserved=2 * 2**20))
    cuda = torch.device("cuda", 0)
    assert metrics.interval_memory(cuda) == dict(memory_mb=3.0, memory_reserved_mb=8.0)
    assert metrics.interval_memory(cuda) == dict(memory_mb=1.0, memory_reserved_mb=2.0)
    assert set(metrics.interval_memory(torch.device("cpu"))) == {"memory_mb"}
    line = metrics.format_train_line(dict(
        iteration=1, consumed_samples=8, elapsed_ms=1.0, lr=1e-3, global_batch_size=8, lm_loss=1.0,
        loss_scale=1.0, grad_norm=1.0, skipped_iterations=0, nan_iterations=0, tokens_per_sec=1.0,
        tflops_per_device=1.0, memory_mb=3.0, memory_reserved_mb=8.0), 10)
    assert "memory (MB): 3 | reserved (MB): 8 |" in line


def test_sequence_parallel_linear_backward_runs_under_autocast(monkeypatch):
    """bf16 autocast: the backward ran without autocast, so ``grad (bf16) @ weight (fp32)``
    failed; it now runs under the forward's autocast state (as ``torch.amp.custom_bwd``) and
    gives the gradients of ``F.linear`` under autocast."""
    import torch.distributed as dist

    from hybrid.parallel.linear.functions import sequence_parallel_linear

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    g = torch.Generator().manual_seed(0)
    x0, w0, b0 = (torch.randn(*s, generator=g) for s in ((2, 4, 8), (6, 8), (6,)))
    grads = []
    for fn in (lambda x, w, b: sequence_parallel_linear(x, w, b, None),
               torch.nn.functional.linear):
        x, w, b = (t.clone().requires_grad_(True) for t in (x0, w0, b0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(x, w, b)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        grads.append([t.grad for t in (x, w, b)])
    for got, want in zip(*grads, strict=True):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # bf16 GEMMs, 8-bit mantissa


def test_reduce_from_tp_sums_an_intermediate_in_place(monkeypatch):
    """``_ReduceFromTP`` cloned its input before the all-reduce (and at tp = 1, where nothing is
    reduced); a matmul output is now summed in place, a leaf is still copied."""
    import torch.distributed as dist

    from hybrid.parallel.ops import reduce_from_tp

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: t.mul_(2))  # 2 equal ranks
    w = torch.randn(3, 3, requires_grad=True)
    a = torch.randn(2, 3)
    x = a @ w
    before = x.detach().clone()
    y = reduce_from_tp(x, None)
    assert y.data_ptr() == x.data_ptr() and torch.equal(y, 2 * before)
    y.sum().backward()  # f-bar's backward is the identity
    assert torch.equal(w.grad, a.t() @ torch.ones(2, 3))
    leaf = torch.randn(2, 3)
    assert reduce_from_tp(leaf, None).data_ptr() != leaf.data_ptr()
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert reduce_from_tp(x, None).data_ptr() == x.data_ptr()


def test_the_training_loop_reads_the_host_twice_per_iteration():
    """The real loop (``hybrid.pretrain``, ZeRO-3, dropout, full recompute, 2 micro-batches):
    the mean loss and the grad norm are its only host reads; the stop check read its own
    all-reduced flag every iteration before (3 per iteration)."""
    from hybrid.parallel.spawn import spawn_world
    from scripts.gpu_sync_count import DEFAULT_ARGS, EXPECTED_SYNCS, count_loop_syncs

    got = spawn_world(1, count_loop_syncs, DEFAULT_ARGS, "cpu", timeout_s=120)[0]
    assert len(got) == 5 and all(len(x) == EXPECTED_SYNCS for x in got), got


@pytest.mark.timeout(200)
def test_chunked_zero3_gathers_broadcast_into_their_slots():
    """NCCL's list all-gather gathers into a temporary flat buffer and copies every rank's piece
    out; the chunked ZeRO-3 gathers (and refresh) now broadcast each rank's piece straight into
    its slot of the unit buffer. Same bits as the list all-gather (2 ranks, gloo)."""
    from hybrid.parallel.spawn import spawn_world
    from tests.gpu_path_worlds import list_gathers_by_broadcast

    native, broadcast = spawn_world(2, list_gathers_by_broadcast, timeout_s=120)[0].values()
    assert native["losses"] == broadcast["losses"]
    assert all(torch.equal(native["final"][k], v) for k, v in broadcast["final"].items())
    assert native["calls"]["all_gather"] > 0 and native["calls"]["broadcast"] == 0
    assert broadcast["calls"]["all_gather"] == 0
    assert broadcast["calls"]["broadcast"] == 2 * native["calls"]["all_gather"]  # one per rank


def test_sequence_parallel_mlp_collectives_copy_nothing_at_micro_batch_2(monkeypatch):
    """At micro-batch b > 1 the ``[b, s, h]`` layout made every sequence-parallel gather copy
    its rank-major result and every reduce-scatter stack its input. The MLP's (``token_wise``)
    gather now returns the gather buffer itself and its reduce-scatter reads its input in
    place; the attention's keep one reordering copy each (the core needs sequence order)."""
    import torch.distributed as dist

    from hybrid.parallel.ops import all_gather_seq, reduce_scatter_seq

    seen = {}

    class Done:
        def wait(self):
            pass

    def gather(out, inp, group=None, async_op=False):  # 2 ranks holding the same slice
        out.view(2, -1).copy_(inp.reshape(1, -1).expand(2, -1))
        seen["gather_out"] = out
        return Done()

    def scatter(out, inp, group=None, async_op=False):  # 2 ranks holding the same input
        seen["scatter_in"] = inp
        out.copy_(2 * inp.view(2, -1)[0].view_as(out))
        return Done()

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_single", gather, raising=False)
    monkeypatch.setattr(dist, "reduce_scatter_single", scatter, raising=False)
    x = torch.randn(2, 4, 8)  # [b, s/t, h]
    y = all_gather_seq(x, None, token_wise=True)
    assert y.shape == (2, 8, 8) and y.data_ptr() == seen["gather_out"].data_ptr()
    assert all_gather_seq(x, None).data_ptr() != seen["gather_out"].data_ptr()  # sequence order
    z = torch.randn(2, 8, 8)  # [b, s, h], tokens rank-major
    out = reduce_scatter_seq(z, None, token_wise=True)
    assert seen["scatter_in"].data_ptr() == z.data_ptr()
    torch.testing.assert_close(out, 2 * z.view(2, 2, 4, 8)[0], rtol=0, atol=0)
    reduce_scatter_seq(z, None)
    assert seen["scatter_in"].data_ptr() != z.data_ptr()  # sequence order: one stacking copy
