"""World functions for the save-directory fault tests (tests/test_save_faults.py)."""

from __future__ import annotations

MOCK = ["--mock-data", "--vocab-size", "500", "--num-layers", "1", "--hidden-size", "32",
        "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--log-interval", "1", "--eval-iters", "0", "--seed", "5",
        "--lr-decay-style", "constant"]


def disk_full_on(rank: int, world: int, argv_ok: list[str], argv_full: list[str],
                 full_rank: int) -> str:
    """Run ``argv_ok``, then ``argv_full`` with rank ``full_rank``'s shard writer raising
    ``OSError(ENOSPC)`` midway through its file; returns the error this rank raised."""
    import errno
    import os

    import hybrid.checkpoint.stream as stream
    from hybrid.checkpoint.agree import SaveFailedError
    from tests.pretrain_worlds import run_configs

    run_configs(rank, world, [argv_ok])
    real = stream.staged

    def full(entries):
        for i, t in enumerate(real(entries)):
            if i == 2 and rank == full_rank:  # some bytes of the file are on disk already
                # as file.write raises it: no file name
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            yield t

    stream.staged = full
    try:
        run_configs(rank, world, [argv_full])
    except SaveFailedError as e:
        return f"errno={e.errno} {e}"
    finally:
        stream.staged = real
    return "no error"
