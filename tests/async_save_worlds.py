"""World functions for the ``--async-save`` tests (tests/test_async_save.py)."""

from __future__ import annotations


def async_events(rank: int, world: int, argvs: list[list[str]], stop_at: int) -> list:
    """Run each argv with a slow shard writer (0.3 s a file), recording the order of training
    steps, snapshots and publications; the last argv gets SIGTERM during step ``stop_at``.
    Returns ``([(history, events) per argv], [(buffer bytes, dry-run bytes) per save])``."""
    import os
    import signal
    import time

    import hybrid.checkpoint.async_save as async_save
    import hybrid.checkpoint.shards as shards
    import hybrid.training as training
    from tests.pretrain_worlds import run_configs

    events: list = []
    sizes: list = []  # (the snapshot buffer's bytes, what the dry run reports) per save
    write, publish, step = shards.write_shard, shards.publish, training.train_step
    save = async_save.AsyncSaver.save

    def slow_write(*a, **k):
        time.sleep(0.3)
        return write(*a, **k)

    def logged_publish(root, iteration, *a, **k):
        events.append(("publish", iteration))
        return publish(root, iteration, *a, **k)

    def logged_step(*a, **k):
        events.append(("step", len([e for e in events if e[0] == "step"]) + 1))
        if events[-1][1] == stop_at and signal_now[0] and rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(*a, **k)

    def logged_save(self, root, iteration, engine, *a, **k):
        save(self, root, iteration, engine, *a, **k)
        events.append(("snapshot", iteration))
        sizes.append((self.buffer.numel(), async_save.host_snapshot_bytes(engine, self.grid)))

    shards.write_shard, shards.publish = slow_write, logged_publish
    training.train_step = logged_step
    async_save.AsyncSaver.save = logged_save
    signal_now, out = [False], []
    for i, argv in enumerate(argvs):
        events.clear()
        signal_now[0] = i == len(argvs) - 1
        history = run_configs(rank, world, [argv])[0]
        out.append((history, list(events)))
    return out, sizes


def killed_during_background_write(rank: int, world: int, argv: list[str], point: str) -> None:
    """Run ``argv`` (``--async-save``) with every rank killed (``os._exit``) during the
    background write of its second save: ``"start"`` before the shard's first byte,
    ``"midway"`` after two of its tensors, ``"written"`` when every shard is written and rank 0
    is about to publish."""
    import os

    import hybrid.checkpoint.shards as shards
    import hybrid.checkpoint.stream as stream
    from tests.pretrain_worlds import run_configs

    calls = []

    def second(real, after=None):
        def wrapped(*a, **k):
            calls.append(1)
            if len(calls) == 2 and after is None:
                os._exit(137)
            return real(*a, **k) if after is None or len(calls) < 2 else after(real(*a, **k))
        return wrapped

    def die_after_two(tensors):
        for i, t in enumerate(tensors):
            if i == 2:
                os._exit(137)
            yield t

    if point == "start":
        shards.write_shard = second(shards.write_shard)
    elif point == "midway":
        stream.staged = second(stream.staged, after=die_after_two)
    else:
        shards.publish = second(shards.publish)
    run_configs(rank, world, [argv])


def poll_on_the_host(rank: int, world: int) -> list:
    """:meth:`AsyncSaver.poll` with the grid's device on ``meta`` (no tensor there can reach
    the host, so a flag all-reduced on the device fails): rank 1's write finishes only after
    the first poll. Returns what each poll decided (``"wait"`` / ``"publish"``)."""
    import threading
    import types

    import torch
    import torch.distributed as dist

    from hybrid.checkpoint.async_save import AsyncSaver, Pending

    saver = AsyncSaver(types.SimpleNamespace(device=torch.device("meta"), rank=rank))
    release = threading.Event()
    if rank == 0:
        release.set()
    saver.pending = Pending("unused", 7, None, None,
                            thread=threading.Thread(target=release.wait, daemon=True))
    saver.pending.thread.start()
    decided = []

    def finish(report=True):
        saver.pending = None
        decided.append("publish")

    saver._finish = finish
    saver.poll()  # rank 1 is still writing
    if saver.pending is not None:
        decided.append("wait")
        release.set()
        saver.pending.thread.join()
    dist.barrier()
    saver.poll()
    return decided
