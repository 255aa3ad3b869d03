"""World functions and fixtures for the end-to-end pretraining tests."""

from __future__ import annotations

from pathlib import Path

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
         "32", "--hidden-dropout", "0", "--attention-dropout", "0"]


def prepare_data(directory: Path) -> tuple[str, str]:
    """The embedded corpus (first ~150 kB), a 600-id tokenizer and its indexed dataset."""
    # imported here, not at the top: every rank of a run_configs world imports this module,
    # and preprocessing's imports (Hugging Face datasets, sentencepiece) cost ~0.7 CPU-s there
    from data.preprocess import preprocess
    from tests.data_helpers import tiny_corpus, tiny_tokenizer

    tok = tiny_tokenizer(directory)
    corpus = tiny_corpus(directory)
    prefix = directory / "stdlib"
    preprocess([str(corpus)], str(prefix), str(tok), json_keys=("text",), workers=1,
               append_eod=True, progress=False)
    return str(prefix) + "_text_document", str(tok)


def run_configs(rank: int, world: int, argvs: list[list[str]]) -> list[list[dict]]:
    """Run ``hybrid.pretrain`` in this spawned world once per argv; return each history."""
    from hybrid.job.cli import parse_config
    from hybrid.job.config_checks import validate
    from hybrid.job.run import run

    out = []
    for argv in argvs:
        cfg = parse_config(argv)
        out.append(run(validate(cfg))["history"])
    return out


def crash_while_saving(rank: int, world: int, argv_ok: list[str], argv_crash: list[str]) -> None:
    """Run ``argv_ok``, then ``argv_crash`` with the process killed (``os._exit``) after every
    shard of its final checkpoint is written but before the checkpoint is published."""
    import os

    import hybrid.checkpoint.shards as checkpointing

    run_configs(rank, world, [argv_ok])

    def killed(*args, **kwargs):
        os._exit(137)

    checkpointing.publish = killed
    run_configs(rank, world, [argv_crash])


def sigterm_at(rank: int, world: int, argv: list[str], iteration: int) -> list[dict]:
    """Run ``argv`` with SIGTERM delivered to rank 0 during training step ``iteration``."""
    import os
    import signal

    import hybrid.training as training

    step, calls = training.train_step, []

    def step_then_signal(*args, **kwargs):
        calls.append(1)
        if rank == 0 and len(calls) == iteration:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(*args, **kwargs)

    training.train_step = step_then_signal
    return run_configs(rank, world, [argv])[0]


def sigterm_in_evaluation(rank: int, world: int, argv: list[str], batch: int) -> tuple:
    """Run ``argv`` with SIGTERM delivered to rank 0 while the first evaluation reads its
    micro-batch ``batch``; returns ``(history, micro-batches each evaluation read)``."""
    import os
    import signal

    import hybrid.training as training

    evaluate, counts = training.evaluate, []

    def counted(engine, batches, n, grid, stop=None):
        counts.append(0)

        def reading():
            for b in batches:
                counts[-1] += 1
                if rank == 0 and len(counts) == 1 and counts[-1] == batch:
                    os.kill(os.getpid(), signal.SIGTERM)
                yield b
        return evaluate(engine, reading(), n, grid, stop)

    training.evaluate = counted
    return run_configs(rank, world, [argv])[0], counts


def engine_lifetime(rank: int, world: int, argv: list[str]) -> tuple[bool, bool]:
    """``(collected without close, collected after close)`` for the engine of a short run."""
    import gc
    import weakref

    from hybrid.job.cli import parse_config
    from hybrid.job.config_checks import validate
    from hybrid.job.run import run

    cfg = parse_config(argv)
    out = []
    for close in (False, True):
        engine = run(validate(cfg))["engine"]
        if close:
            engine.close()
        ref = weakref.ref(engine)
        del engine
        gc.collect()
        out.append(ref() is None)
    return tuple(out)


def printed_sigterm_in_evaluation(rank: int, world: int, argv: list[str], batch: int) -> tuple:
    """:func:`sigterm_in_evaluation` that also returns the lines this rank printed."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        history, counts = sigterm_in_evaluation(rank, world, argv, batch)
    return history, counts, out.getvalue().splitlines()


def printed_run(rank: int, world: int, argv: list[str]) -> tuple:
    """``(history, lines printed)`` of one ``hybrid.pretrain`` run of ``argv`` on this rank."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        (history,) = run_configs(rank, world, [argv])
    return history, out.getvalue().splitlines()
