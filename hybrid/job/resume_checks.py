"""What ``--load`` may and may not change, decided before any process group starts.

A resumed run reads the checkpoint's ``metadata.json`` and compares it with its own settings:

* **the model** must have the same shape: a differing field (``hidden_size 64 in the checkpoint,
  128 here``) is named together with the first parameter whose shape differs;
* **the data position** (``consumed_samples``) only means the same samples with the same
  ``--seq-length``, ``--data-path`` (prefixes and blend weights), ``--split``, ``--seed`` and
  ``--mock-data``; a change would silently skip or repeat data, so it is refused with the old and
  the new value (``--finetune`` starts a new data order from iteration 0 instead);
* **``--train-iters``** must not be below the checkpoint's iteration;
* **``--save``** may hold checkpoints only when this run resumes them (``--load`` of the same
  directory, without ``--finetune``) or says ``--overwrite-save`` (ours; Megatron-LM writes a
  new run's checkpoints over another's silently, and moves the pointer to them);
* **the LR and weight-decay schedule** (peak and minimum LR, warmup, decay length and style,
  weight-decay range) must be the checkpoint's, as Megatron-LM asserts, unless
  ``--use-checkpoint-opt_param-scheduler`` (continue the checkpoint's) or
  ``--override-opt-param-scheduler`` (this run's) says which to follow; ``--no-load-optim``
  restarts it (:mod:`hybrid.job.schedule_setup`).
"""

from __future__ import annotations

import dataclasses

from hybrid.config import PretrainConfig

SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                "max_position_embeddings", "untie_embeddings_and_output_weights",
                "position_embedding_type", "normalization", "swiglu", "num_query_groups",
                "kv_channels", "add_bias_linear", "add_qkv_bias", "qk_layernorm")
"""GPTConfig fields that change a parameter's shape or name (dropout, init std, epsilon and the
RoPE frequencies do not: a fine-tune may change ``--rotary-base``). A checkpoint written before
a field existed holds GPTConfig's default for it."""

DATA_POSITION_FIELDS = (("model", "seq_length"), ("data", "data_path"), ("data", "split"),
                        ("data", "seed"), ("data", "mock_data"))
"""Settings that decide which samples ``consumed_samples`` points at."""


class ResumeMismatch(ValueError):
    """The run's settings contradict the checkpoint it resumes; the message names the values."""


def checkpoint_metadata(load: str) -> dict | None:
    """``metadata.json`` of the latest complete checkpoint under ``load``; None when there is none.

    Raises:
        hybrid.checkpoint.published.IncompleteCheckpointError: a file is missing, or the
            checkpoint is in a format (or version) this code does not read.
        ResumeMismatch: ``load`` is one iteration's directory (``.../iter_0000500``) rather than
            the checkpoint root (a run would otherwise silently start from scratch).
    """
    from pathlib import Path

    from hybrid.checkpoint.directory import iteration_of_dir, latest_iteration
    from hybrid.checkpoint.registry import checked_metadata

    if not load or not Path(load).is_dir():
        return None
    latest = latest_iteration(load)
    if latest is None and (n := iteration_of_dir(load)) is not None:
        raise ResumeMismatch(f"--load {load} is one iteration's directory, not a checkpoint root: "
                             f"give --load {Path(load).parent} (a run resumes from the root's "
                             f"latest complete iteration, here {n} or later)")
    return None if latest is None else checked_metadata(load, latest)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _with_defaults(model_fields: dict) -> dict:
    """A checkpoint's ``model`` entry with GPTConfig's defaults for the fields it predates."""
    from models.config import GPTConfig

    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    return {**{k: defaults[k] for k in SHAPE_FIELDS if k not in model_fields}, **model_fields}


def _parameter_shapes(model_fields: dict) -> dict[str, tuple[int, ...]]:
    import torch

    from models.gpt import GPT, GPTConfig

    known = {f.name for f in dataclasses.fields(GPTConfig)}
    with torch.device("meta"):
        model = GPT(GPTConfig(**{k: v for k, v in model_fields.items() if k in known}))
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def check_model(meta: dict, gpt, load: str, position_hint: bool = False) -> None:
    """Raise :class:`ResumeMismatch` when ``gpt`` (a ``GPTConfig``) differs in shape from the
    checkpoint's model, naming the differing fields and the first differing parameter;
    ``position_hint``: say how to keep the position table at another ``--seq-length``."""
    saved, ours = _with_defaults(meta["model"]), dataclasses.asdict(gpt)
    learned = ours.get("position_embedding_type") == "learned_absolute"
    diffs = [f"{_flag(k)} {saved.get(k)} in the checkpoint, {ours[k]} here" for k in SHAPE_FIELDS
             if saved.get(k) != ours[k] and (learned or k != "max_position_embeddings")]
    pos = saved.get("max_position_embeddings")
    if position_hint and learned and pos != ours["max_position_embeddings"] and pos is not None:
        diffs.append(f"--max-position-embeddings defaults to --seq-length: give "
                     f"--max-position-embeddings {pos} to keep the checkpoint's position table at "
                     "another --seq-length")
    if not diffs:
        return
    old, new = _parameter_shapes(saved), _parameter_shapes(ours)
    first = (next((n for n in new if old.get(n) != new[n]), None)
             or next(iter(sorted(set(old) - set(new))), None))
    where = ""
    if first is not None:
        where = (f"; first differing parameter {first}: {old.get(first, 'absent')} in the "
                 f"checkpoint, {new.get(first, 'absent')} here")
    raise ResumeMismatch(f"--load {load} (iteration {meta['iteration']}) holds another model: "
                         f"{'; '.join(diffs)}{where}. Use the checkpoint's model flags or another "
                         "--load")


def check_resume(cfg: PretrainConfig, gpt, meta: dict, schedule: dict) -> None:
    """Every pre-flight check of a resume from ``meta`` (see the module docstring).

    Args:
        schedule: this run's schedule settings
            (:func:`hybrid.job.schedule_setup.schedule_settings`).

    Raises:
        ResumeMismatch: the first contradiction found, with the old and the new value.
    """
    ck = cfg.checkpoint
    positions = meta.get("model", {}).get("max_position_embeddings")
    if positions is not None and cfg.model.seq_length > positions:
        saved_seq = meta.get("config", {}).get("model", {}).get("seq_length", "?")
        raise ResumeMismatch(
            f"--seq-length {cfg.model.seq_length} is longer than the position table of the model "
            f"in --load {ck.load} ({positions} positions, --max-position-embeddings): neither a "
            f"resume nor --finetune can train it on more than {positions} tokens per sample; give "
            f"--seq-length {positions} or less (a resume also needs the checkpoint's --seq-length "
            f"{saved_seq})")
    if ck.finetune:  # a new data order: --seq-length may change, the model may not
        check_model(meta, gpt, ck.load, position_hint=True)
        return
    # first: a changed --seq-length also changes the default max-position
    _check_data_position(cfg, meta)
    check_model(meta, gpt, ck.load)
    _check_schedule(cfg, meta, schedule)


def _check_schedule(cfg: PretrainConfig, meta: dict, schedule: dict) -> None:
    """A schedule that differs from the checkpoint's needs one of Megatron-LM's two flags to say
    which to follow (a longer ``--train-iters`` without ``--lr-decay-iters`` changes the decay)."""
    from hybrid.job.schedule_setup import differences, saved_settings

    ck = cfg.checkpoint
    saved = saved_settings(meta)
    if (saved is None or ck.override_opt_param_scheduler or ck.use_checkpoint_opt_param_scheduler
            or ck.no_load_optim):
        return
    diffs = differences(saved, schedule)
    if not diffs:
        return
    it = meta["iteration"]
    raise ResumeMismatch(
        f"this run's LR / weight-decay schedule differs from the one of the checkpoint in --load "
        f"{ck.load} (iteration {it}; checkpoint -> this run: {'; '.join(diffs)}). Pass "
        f"--use-checkpoint-opt_param-scheduler to continue the checkpoint's schedule, or "
        f"--override-opt-param-scheduler to follow this run's flags from iteration {it} on "
        "(Megatron-LM refuses the difference too)")


def _check_data_position(cfg: PretrainConfig, meta: dict) -> None:
    ck = cfg.checkpoint
    it = meta["iteration"]
    if cfg.training.train_iters < it:
        raise ResumeMismatch(f"--train-iters {cfg.training.train_iters} is below the iteration of "
                             f"the checkpoint in --load {ck.load} ({it}); give --train-iters {it} "
                             "or more to train on from it")
    saved_cfg = meta.get("config", {})
    for section, name in DATA_POSITION_FIELDS:
        if name not in saved_cfg.get(section, {}):
            continue
        old, new = saved_cfg[section][name], getattr(getattr(cfg, section), name)
        if old != new:
            raise ResumeMismatch(
                f"{_flag(name)} {_show(new)} differs from the checkpoint's {_show(old)} (--load "
                f"{ck.load}, iteration {it}): the resumed data position "
                f"({meta['train_state']['consumed_samples']} consumed samples) would point at "
                f"other samples, skipping or repeating data. Resume with {_flag(name)} "
                f"{_show(old)}, or start a new data order with --finetune")


def _show(value) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value)) or "(none)"
    return str(value)


def check_save_dir(cfg: PretrainConfig) -> None:
    """Refuse a run whose ``--save`` holds published checkpoints that it does not resume: a
    fresh run (no ``--load``), ``--load`` of another directory, or ``--finetune`` (which
    restarts at iteration 0). Its saves would replace them iteration by iteration and move
    ``latest_checkpointed_iteration.txt`` to its own. ``--load`` of the same directory resumes
    them (also with ``--no-load-optim`` / ``--no-load-rng``: the iterations go on); a directory
    without a pointer is not resumed, so it is refused too. ``--overwrite-save`` allows it.

    Raises:
        ResumeMismatch: naming the directory, the iterations found and the ways out.
    """
    from pathlib import Path

    from hybrid.checkpoint.directory import POINTER, iteration_of_dir, latest_iteration
    from hybrid.checkpoint.names import iteration_dir, list_iterations
    from hybrid.checkpoint.retention import same_directory

    ck = cfg.checkpoint
    if not ck.save or ck.overwrite_save:
        return
    found = [it for it in list_iterations(ck.save)
             if iteration_of_dir(iteration_dir(ck.save, it)) is not None]
    if not found:
        return
    same = same_directory(ck.load, ck.save)
    latest = latest_iteration(ck.save)
    if same and latest is not None and not ck.finetune:
        return
    if same and ck.finetune:
        why, resume = "--finetune restarts at iteration 0", "drop --finetune"
    elif same:
        why = f"no {POINTER} names one to resume"
        resume = f"write the iteration to resume into {Path(ck.save) / POINTER}"
    else:
        why = f"it loads --load {ck.load}, another directory" if ck.load else "no --load of it"
        resume = f"give --load {ck.save}"
    raise ResumeMismatch(
        f"--save {ck.save} holds the checkpoints of another run ({_iterations(found, latest)}) "
        f"that this run does not resume ({why}): its saves would overwrite them. To continue "
        f"that run {resume}; otherwise give another --save directory, or --overwrite-save to "
        "save into this one anyway")


def _iterations(found: list[int], latest: int | None) -> str:
    """``iterations 2, 4, 6, latest 6`` (the middle of a long list elided)."""
    shown = ", ".join(map(str, found)) if len(found) <= 6 else (
        f"{', '.join(map(str, found[:3]))}, ..., {', '.join(map(str, found[-2:]))}: "
        f"{len(found)} checkpoints")
    name = "iteration" if len(found) == 1 else "iterations"
    return f"{name} {shown}" + (f", latest {latest}" if latest is not None else "")
