"""No unexpected device-to-host synchronisation in a training step (issue 14, GPU path).

One CUDA process runs ``hybrid.training.train_step`` (2 micro-batches) with every ZeRO stage under
``torch.cuda.set_sync_debug_mode("warn")`` and counts the synchronising calls. A step needs
exactly two: the global gradient norm (``grad_norm.global_grad_norm`` reads the norm and the
overflow flag for clipping and the skip decision) and the data-parallel mean loss
(``train_step``'s NaN check). Any other one (a loss copied to the host per micro-batch, an
``.item()`` per gradient tensor) fails the test. Skipped without a CUDA device.
"""

import warnings

import pytest
import torch

from hybrid.parallel.spawn import spawn_world

EXPECTED_SYNCS = 2
"""Per training step: the grad-norm read and the mean-loss read (see the module docstring)."""


def _count_syncs(rank: int, world: int) -> dict:
    from hybrid.config import PretrainConfig
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallelize import parallelize
    from hybrid.training import train_step
    from hybrid.zero.config import OptimizerConfig, ZeroConfig
    from models.gpt import GPT, GPTConfig

    grid = ProcessGrid(tp=1)
    out = {}
    for stage in range(4):
        for precision in ("fp32", "bf16"):
            torch.manual_seed(0)
            cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256,
                            max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0)
            model = GPT(cfg).to(grid.device)
            engine = parallelize(model, grid, PretrainConfig(
                zero=ZeroConfig(stage=stage, precision=precision, param_persistence_threshold=100),
                optimizer=OptimizerConfig(lr=1e-3)))
            g = torch.Generator().manual_seed(1)
            batches = [torch.randint(0, 256, (2, 17), generator=g) for _ in range(2)]
            train_step(engine, batches, 1e-3, grid)  # warm-up: lazy allocations, cuBLAS handles
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    train_step(engine, batches, 1e-3, grid)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            out[(stage, precision)] = [str(w.message)[:200] for w in caught
                                       if "synchroniz" in str(w.message)]
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_train_step_syncs_only_for_norm_and_loss():
    got = spawn_world(1, _count_syncs, timeout_s=300, backend="nccl")[0]
    for key, syncs in got.items():
        assert len(syncs) == EXPECTED_SYNCS, (key, syncs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_loop_syncs_only_for_norm_and_loss():
    """The real loop (``hybrid.pretrain``: loader, dropout, full recompute, ZeRO-3, logging,
    stop check), counted by ``torch.cuda.set_sync_debug_mode`` from the second iteration."""
    from scripts.gpu_sync_count import DEFAULT_ARGS, count_loop_syncs

    # 4 x 512 tokens per micro-batch (flags given twice: the last one counts)
    shape = ["--seq-length", "512", "--micro-batch-size", "4", "--global-batch-size", "8"]
    for extra in ([], ["--bf16"], ["--bf16", "--zero-stage", "1"]):
        got = spawn_world(1, count_loop_syncs, DEFAULT_ARGS + shape + extra, "cuda",
                          timeout_s=300, backend="nccl")[0]
        assert got and all(len(x) == EXPECTED_SYNCS for x in got), (extra, got)
