import os

# Multi-process tests on a 2-core machine: one intra-op thread per rank avoids oversubscription.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# spawn_world's ranks fork from one server that imported torch once (hybrid.parallel.spawn):
# ~2 CPU-s of torch import saved per rank, some 160 ranks in the suite.
os.environ.setdefault("HYBRID_SPAWN_START_METHOD", "forkserver")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A test that leaves the default process group initialized in pytest's own process fails
    here, by name, instead of breaking every later test that starts one."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("this test left torch.distributed's default process group initialized")
