"""The datasets a pretraining job reads, sized as Megatron-LM sizes them, and the micro-batches
a rank reads from them (:func:`micro_batches`); shared by the run (:mod:`hybrid.job.run`)
and the pre-flight check of read-only index caches (:mod:`hybrid.job.preflight`), which runs it
without writing to learn the index names. (No type import of ``Job``: this module sits below
:mod:`hybrid.job.config_checks`.)"""

from __future__ import annotations


def build_datasets(job, state=None):
    """``(train, valid, test)`` datasets sized for the run (None for an empty split).

    ``job``: a validated :class:`hybrid.job.config_checks.Job`; ``state``: a resumed run's
    :class:`hybrid.training.TrainState` (None: a fresh run).

    The validation split holds ``(train_iters // eval_interval + 1) x eval_iters x global
    batch`` samples, the test split ``eval_iters x global batch``, as in Megatron-LM. The
    training split holds ``train_iters x global batch`` samples (Megatron-LM's size), or
    more when a resumed job (``state``: its loaded counters) needs more: its consumed samples
    plus the remaining iterations at this run's global batch, which is larger when the global
    batch grew since the checkpoint or when the consumed samples came at a larger one.
    """
    from data.split import parse_split

    cfg, gbs = job.cfg, job.global_batch_size
    seq, fractions = cfg.model.seq_length, parse_split(cfg.data.split)
    eval_samples = cfg.eval.eval_iters * gbs
    # Megatron-LM's validation size: every evaluation reads new samples (one per interval and
    # one at the end); the test split is evaluated once
    interval = cfg.eval.eval_interval
    valid_samples = (cfg.training.train_iters // interval + 1 if interval else 1) * eval_samples
    train_samples = cfg.training.train_samples or cfg.training.train_iters * gbs
    if job.rampup is not None:  # Megatron-LM's rampup iterations may overshoot --train-samples
        train_samples = max(train_samples, job.rampup.consumed_after(cfg.training.train_iters))
    if state is not None:
        remaining = max(0, cfg.training.train_iters - state.iteration)
        train_samples = max(train_samples, state.consumed_samples + remaining * gbs)
        evals = remaining // interval + 1 if interval else 1
        valid_samples = max(valid_samples, state.consumed_valid_samples + evals * eval_samples)
    counts = (train_samples,
              valid_samples if fractions[1] > 0 else 0,
              eval_samples if fractions[2] > 0 else 0)
    if cfg.data.mock_data:
        from data.mock_dataset import MockGPTDataset, MockLowLevelDataset

        low = MockLowLevelDataset(job.gpt.vocab_size, eod_id(cfg, job.gpt.vocab_size))
        return tuple(MockGPTDataset(low, cfg.data.split, i, n, seq, cfg.data.seed) if n
                     else None for i, n in enumerate(counts))
    from data.gpt_dataset import build_gpt_datasets

    counts = _skip_empty_eval_splits(cfg, counts)
    return build_gpt_datasets(cfg.data.data_path, cfg.data.split, seq, cfg.data.seed, counts,
                              cache_dir=cfg.data.data_cache_path,
                              surplus=cfg.data.mid_level_dataset_surplus)


def _skip_empty_eval_splits(cfg, counts: tuple) -> tuple:
    """``counts`` with the evaluation splits that hold no document zeroed, as Megatron-LM skips
    them (``data.split.skipped_splits``); global rank 0 prints a note for each."""
    import torch.distributed as dist

    from data.split import SPLIT_NAMES, skip_note, skipped_eval_splits

    skipped = skipped_eval_splits(cfg.data.data_path, cfg.data.split) if cfg.eval.eval_iters else []
    if skipped and (not dist.is_initialized() or dist.get_rank() == 0):
        for name in skipped:
            print(skip_note(cfg.data.split, name), flush=True)
    return tuple(0 if SPLIT_NAMES[i] in skipped else n for i, n in enumerate(counts))


def eod_id(cfg, vocab_size: int) -> int:
    """The end-of-document id of the run's tokenizer: ``--tokenizer-model``'s eod (eos),
    ``<|endoftext|>`` of a ``--vocab-file``, else ``vocab_size - 1`` (Megatron-LM's
    NullTokenizer). Raises ValueError when the tokenizer has none."""
    d = cfg.data
    if d.tokenizer_model:
        from data.tokenizer import load_tokenizer

        return int(load_tokenizer(d.tokenizer_model, d.tokenizer_type).eod)
    if d.vocab_file:
        import json
        from pathlib import Path

        vocab = json.loads(Path(d.vocab_file).read_text(encoding="utf-8"))
        if "<|endoftext|>" not in vocab:
            raise ValueError(f"--vocab-file {d.vocab_file} has no <|endoftext|> (the eod)")
        return int(vocab["<|endoftext|>"])
    return vocab_size - 1


def micro_batches(dataset, consumed: int, job, grid):
    """This rank's micro-batches of ``dataset`` from ``consumed`` samples on
    (:func:`data.loader.build_data_loader` over ``grid``'s data-parallel rank), each checked
    against the vocabulary (:func:`data.batches.checked_tokens`) and, with
    ``--reset-position-ids``, ``--reset-attention-mask`` or ``--eod-mask-loss``, given its
    documents' layout (:func:`data.batches.packed_documents`). ``job``: a validated
    :class:`hybrid.job.config_checks.Job`; ``grid``: its
    :class:`hybrid.parallel.grid.ProcessGrid`."""
    from data.batches import checked_tokens, packed_documents
    from data.loader import build_data_loader

    cfg = job.cfg
    # pinned host batches on CUDA: train_step's non_blocking copy is then truly asynchronous
    loader = build_data_loader(dataset, consumed, cfg.training.micro_batch_size, grid.dp_rank,
                               grid.dp_size, pin_memory=grid.device.type == "cuda")
    batches = checked_tokens(loader, job.gpt.vocab_size, cfg.data.data_path)
    d = cfg.data
    if not (d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss):
        return batches
    return packed_documents(batches, eod_id(cfg, job.gpt.vocab_size), d.reset_position_ids,
                            d.reset_attention_mask, d.eod_mask_loss)
