"""DeepSpeed ZeRO peer of ``scripts/bench_zero.py`` on the common workload (``workload.py``).

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node N scripts/peers/peer_deepspeed.py S

S: ZeRO stage 0-3. ``deepspeed.initialize`` adopts the gloo group; fp32, the workload's
``torch.optim.AdamW`` as a client optimizer, gradient clipping off (DeepSpeed's default is 1.0;
the other peers do not clip), so the update is the other peers'. Needs ``pip install
hybrid-zero[bench]``; on CPU DeepSpeed JIT-builds its shared-memory comm op on first use (g++,
ninja; cached under ~/.cache/torch_extensions).
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload as W  # noqa: E402


def missing_reason() -> str | None:
    """Why this peer cannot run here (None when DeepSpeed imports)."""
    try:
        import deepspeed  # noqa: F401
    except Exception as err:  # ImportError, or a broken build raising at import
        return (f"deepspeed does not import ({type(err).__name__}: {str(err)[:80]}); "
                "pip install -e '.[bench]'")
    return None


def run(stage: int) -> dict:
    """One launch at ZeRO ``stage`` in an initialised process group (see :func:`peer_torch.run`)."""
    import deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    _, c = W.cfg_from_env()
    steps, warmup = W.steps_from_env()
    model = W.build_model(c)
    config = {"train_micro_batch_size_per_gpu": c.mbs, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "gradient_clipping": 0.0, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=W.make_adamw(model.parameters()),
                                      config=config, dist_init_required=False)
    dist.barrier()
    t_init = time.time() - W.T_PROC_START
    state = {}

    def step(x, y, i):
        loss = W.loss_fn(engine(x), y)
        engine.backward(loss)
        if i == steps - 1:
            # ZeRO-3's gradient bucket is a communication buffer of mostly untouched pages
            state["bytes"] = W.tensor_bytes([engine.module, engine.optimizer],
                                            skip=frozenset({"ipg_buckets"}))
        engine.step()
        return loss

    times, losses = W.train(step, c, rank)
    return dict(name=f"deepspeed_z{stage}", rank=rank, world=world, dp=world, c=c, times=times,
                warmup=warmup, losses=W.world_mean(losses), t_init=t_init,
                state_bytes=state.get("bytes"), extra={"deepspeed": deepspeed.__version__})


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in ("0", "1", "2", "3"):
        sys.exit("usage: peer_deepspeed.py STAGE (0, 1, 2 or 3)")
    if reason := missing_reason():
        sys.exit(reason)
    W.init_dist()  # the gloo group first; deepspeed.comm adopts it
    W.report(**run(int(sys.argv[1])))
    dist.barrier()
    # DeepSpeed 0.19's CPU comm op leaves a joinable thread that aborts the interpreter's exit
    # ("terminate called without an active exception"); the result is out, so leave directly.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
