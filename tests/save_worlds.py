"""World functions for the save-directory fault tests (tests/test_save_faults.py)."""

from __future__ import annotations

MOCK = ["--mock-data", "--vocab-size", "500", "--num-layers", "1", "--hidden-size", "32",
        "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--log-interval", "1", "--eval-iters", "0", "--seed", "5",
        "--lr-decay-style", "constant"]


def disk_full_on(rank: int, world: int, runs: list[tuple[list[str], list[str]]],
                 full_rank: int) -> list[str]:
    """For each ``(argv_ok, argv_full)``: run ``argv_ok``, then ``argv_full`` with rank
    ``full_rank``'s shard writer raising ``OSError(ENOSPC)`` midway through its file; returns
    the error this rank raised in each."""
    import errno
    import os

    import hybrid.checkpoint.stream as stream
    from hybrid.checkpoint.agree import SaveFailedError
    from tests.pretrain_worlds import run_configs

    real, out = stream.staged, []

    def full(entries):
        for i, t in enumerate(real(entries)):
            if i == 2 and rank == full_rank:  # some bytes of the file are on disk already
                # as file.write raises it: no file name
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            yield t

    for argv_ok, argv_full in runs:
        run_configs(rank, world, [argv_ok])
        stream.staged = full
        try:
            run_configs(rank, world, [argv_full])
            out.append("no error")
        except SaveFailedError as e:
            out.append(f"errno={e.errno} {e}")
        finally:
            stream.staged = real
    return out


def roll_back_and_resume(rank: int, world: int, base: list[str], ck: str) -> list[list[int]]:
    """Save at 2, 4 and 6; roll the pointer back to 4 and resume to 5 with ``--save-keep-last
    1``; then a fresh run to 1 in the same directory (``--overwrite-save``). The directory's
    iterations after each."""
    from pathlib import Path

    from hybrid.checkpoint.directory import list_iterations
    from tests.pretrain_worlds import run_configs

    save = ["--save", ck]
    run_configs(rank, world, [base + save + ["--train-iters", "6", "--save-interval", "2"]])
    seen = [list_iterations(ck)]
    if rank == 0:
        (Path(ck) / "latest_checkpointed_iteration.txt").write_text("4\n")
    keep = save + ["--save-keep-last", "1"]
    run_configs(rank, world, [base + keep + ["--train-iters", "5", "--load", ck]])
    seen.append(list_iterations(ck))
    run_configs(rank, world, [base + keep + ["--train-iters", "1", "--overwrite-save"]])
    seen.append(list_iterations(ck))
    return seen


def second_job(rank: int, world: int, argv: list[str], holder_pid: int) -> list[str]:
    """Run ``argv`` while process ``holder_pid`` holds its ``--save``'s lock (refused), then
    after rank 0 killed that process (taken over). Returns the refusal, the directory's
    entries after it, and how many iterations the second attempt trained."""
    import os
    import signal

    import torch.distributed as dist

    from hybrid.checkpoint.lock import SaveDirectoryInUseError
    from tests.pretrain_worlds import run_configs

    out = []
    try:
        run_configs(rank, world, [argv])
        out.append("not refused")
    except SaveDirectoryInUseError as e:
        out.append(str(e))
    out.append(" ".join(sorted(os.listdir(argv[argv.index("--save") + 1]))))  # nothing saved
    if rank == 0:
        os.kill(holder_pid, signal.SIGKILL)  # the test reaps it later: a zombie until then
    dist.barrier()
    out.append(str(len(run_configs(rank, world, [argv])[0])))
    return out


def run_finished_again(rank: int, world: int, base: list[str], ck: str) -> tuple[int, int, list]:
    """Train to 2 saving in ``ck``, then the same command with ``--load ck``: the metadata's
    mtime (ns) after each, and the directory's iterations."""
    from pathlib import Path

    from hybrid.checkpoint.directory import list_iterations
    from tests.pretrain_worlds import run_configs

    argv = base + ["--save", ck, "--train-iters", "2"]
    meta = Path(ck) / "iter_0000002" / "metadata.json"
    run_configs(rank, world, [argv])
    before = meta.stat().st_mtime_ns
    run_configs(rank, world, [argv + ["--load", ck]])
    return before, meta.stat().st_mtime_ns, list_iterations(ck)
