"""The run's learning-rate and weight-decay schedule from its flags, built as Megatron-LM's
``get_optimizer_param_scheduler`` builds it, and which schedule a resumed run follows.

Lengths are in samples (``--lr-warmup-iters W`` is ``W x global batch``, ``--lr-warmup-fraction
f`` is ``f x`` the decay samples, unrounded; sample-based training gives them directly), and the
schedule's index is the samples of the steps that updated the weights
(``TrainState.scheduler_samples``). The settings are stored in every checkpoint's
``metadata.json`` under Megatron-LM's ``state_dict`` names. On ``--load`` the checkpoint's
values of :data:`COMPARED` must equal this run's, as Megatron-LM asserts, unless
``--use-checkpoint-opt_param-scheduler`` (continue the checkpoint's) or
``--override-opt-param-scheduler`` (this run's flags) says which to follow; ``--no-load-optim``
restarts the schedule from sample 0, as Megatron-LM does when it loads no scheduler state.
"""

from __future__ import annotations

import dataclasses

from hybrid.batch_rampup import BatchRampup
from hybrid.config import PretrainConfig
from hybrid.config_fields import ConfigError
from hybrid.schedule import LRSchedule, ParamSchedule, WeightDecaySchedule

COMPARED = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style",
            "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style", "decoupled_lr",
            "decoupled_min_lr")
"""What Megatron-LM's ``OptimizerParamScheduler.load_state_dict`` checks against the run, and
the decoupled group's peak and minimum (its optimizer state carries them per parameter group)."""

LABELS = dict(max_lr="--lr", min_lr="--min-lr", lr_warmup_steps="warmup samples",
              lr_decay_steps="decay samples", lr_decay_style="--lr-decay-style",
              start_wd="start weight decay", end_wd="end weight decay",
              wd_incr_steps="weight decay increment samples",
              wd_incr_style="--weight-decay-incr-style", decoupled_lr="--decoupled-lr",
              decoupled_min_lr="--decoupled-min-lr (default --min-lr)")


DEFAULT_TRAIN_ITERS = 100
"""Iterations when neither ``--train-iters`` nor ``--train-samples`` is given (Megatron-LM
requires one)."""


def training_iterations(cfg: PretrainConfig, global_batch_size: int) -> int:
    """The run's iterations: ``--train-iters``, or ``--train-samples // global batch`` as
    Megatron-LM's ``update_train_iters`` (a last, incomplete batch is not trained).

    Raises:
        ConfigError: iteration- and sample-based flags mixed (Megatron-LM's assertions), or
            fewer training samples than one global batch.
    """
    t = cfg.training
    if t.train_samples is None:
        samples = [f for f, v in (("--rampup-batch-size", t.rampup_batch_size),
                                  ("--lr-warmup-samples", t.lr_warmup_samples),
                                  ("--lr-decay-samples", t.lr_decay_samples),
                                  ("--lr-wsd-decay-samples", t.lr_wsd_decay_samples)) if v]
        if samples:
            verb = "needs" if len(samples) == 1 else "need"
            raise ConfigError(f"{', '.join(samples)} {verb} sample-based training "
                              "(--train-samples instead of --train-iters)")
        return t.train_iters if t.train_iters is not None else DEFAULT_TRAIN_ITERS
    iters = [f for f, v in (("--train-iters", t.train_iters), ("--lr-warmup-iters",
                                                                t.lr_warmup_iters),
                            ("--lr-decay-iters", t.lr_decay_iters),
                            ("--lr-wsd-decay-iters", t.lr_wsd_decay_iters)) if v]
    if iters:
        raise ConfigError(f"--train-samples {t.train_samples} is sample-based training: give "
                          f"the *-samples flags instead of {', '.join(iters)}")
    rampup = batch_rampup(cfg, global_batch_size)
    if t.train_samples < (rampup.start if rampup else global_batch_size):
        raise ConfigError(f"--train-samples {t.train_samples} is less than one global batch "
                          f"({rampup.start if rampup else global_batch_size})")
    return rampup.iterations(t.train_samples) if rampup else t.train_samples // global_batch_size


def batch_rampup(cfg: PretrainConfig, global_batch_size: int) -> BatchRampup | None:
    """``--rampup-batch-size`` as a :class:`hybrid.batch_rampup.BatchRampup` (None without).

    Raises:
        ConfigError: not three non-negative integers, or Megatron-LM's rampup assertions.
    """
    given = cfg.training.rampup_batch_size
    if given is None:
        return None
    try:
        start, incr, samples = (int(v) for v in given)
        return BatchRampup(start, incr, samples, global_batch_size)
    except ValueError as e:
        msg = str(e) if str(e).startswith("--") else "give three integers START INCR SAMPLES"
        raise ConfigError(f"--rampup-batch-size {' '.join(map(str, given))}: {msg}") from None


def _lengths(cfg: PretrainConfig, gbs: int) -> tuple[float, int, int | None, int, str, str]:
    """``(warmup, decay, wsd, weight-decay increment)`` in samples and the flags that gave the
    warmup and the decay, as ``get_optimizer_param_scheduler`` resolves them."""
    t = cfg.training
    if t.train_samples is not None:
        decay = t.lr_decay_samples if t.lr_decay_samples is not None else t.train_samples
        warmup, wflag = t.lr_warmup_samples, f"--lr-warmup-samples {t.lr_warmup_samples}"
        wsd, incr = t.lr_wsd_decay_samples, t.train_samples
        dflag = f"--lr-decay-samples {decay}"
    else:
        decay_iters = t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters
        decay, dflag = decay_iters * gbs, f"--lr-decay-iters {decay_iters}"
        warmup, wflag = t.lr_warmup_iters * gbs, f"--lr-warmup-iters {t.lr_warmup_iters}"
        wsd = None if t.lr_wsd_decay_iters is None else t.lr_wsd_decay_iters * gbs
        incr = t.train_iters * gbs
    if t.lr_warmup_fraction is not None:
        warmup, wflag = t.lr_warmup_fraction * decay, f"--lr-warmup-fraction {t.lr_warmup_fraction}"
    return warmup, decay, wsd, incr, wflag, dflag


def schedule_settings(cfg: PretrainConfig, global_batch_size: int) -> dict:
    """The run's schedule settings (Megatron-LM's scheduler arguments, lengths in samples), for
    a config whose ``train_iters`` is resolved (:func:`training_iterations`).

    Raises:
        ConfigError: both warmup flags, ``--min-lr`` or ``--lr-warmup-init`` above ``--lr``,
            warmup not shorter than the decay, WSD without its decay length (or longer than the
            decay), or weight-decay increment flags that contradict the style.
    """
    t, lr = cfg.training, cfg.optimizer.lr
    if t.lr_warmup_fraction is not None and (t.lr_warmup_iters or t.lr_warmup_samples):
        given = (f"--lr-warmup-iters {t.lr_warmup_iters}" if t.lr_warmup_iters
                 else f"--lr-warmup-samples {t.lr_warmup_samples}")
        raise ConfigError(f"--lr-warmup-fraction {t.lr_warmup_fraction} and {given}: give only "
                          "one (Megatron-LM refuses both)")
    if t.min_lr > lr or t.lr_warmup_init > lr:
        raise ConfigError(f"need 0 <= --min-lr ({t.min_lr}) <= --lr ({lr}) and --lr-warmup-init "
                          f"({t.lr_warmup_init}) <= --lr")
    warmup, decay, wsd, incr, wflag, dflag = _lengths(cfg, global_batch_size)
    if warmup >= decay:
        raise ConfigError(f"{wflag}: the warmup must be shorter than the decay ({dflag}, "
                          "default the whole run)")
    if t.lr_decay_style == "WSD" and (wsd is None or wsd > decay):
        raise ConfigError(f"--lr-decay-style WSD needs --lr-wsd-decay-iters (or -samples) within "
                          f"the decay ({dflag}), got {wsd} samples")
    start, end = _weight_decay_range(cfg)
    decoupled, decoupled_min = _decoupled(cfg)
    return dict(max_lr=lr, min_lr=t.min_lr, decoupled_lr=decoupled,
                decoupled_min_lr=decoupled_min, lr_warmup_steps=warmup, lr_decay_steps=decay,
                lr_decay_style=t.lr_decay_style, start_wd=start, end_wd=end,
                wd_incr_steps=incr, wd_incr_style=t.weight_decay_incr_style,
                init_lr=t.lr_warmup_init, wsd_decay_steps=wsd,
                lr_wsd_decay_style=t.lr_wsd_decay_style)


def _decoupled(cfg: PretrainConfig) -> tuple[float | None, float | None]:
    """``(peak, minimum)`` of the embedding and output layer's learning rate (Megatron-LM's
    ``--decoupled-lr`` / ``--decoupled-min-lr``, the minimum ``--min-lr`` when not given);
    ``(None, None)`` without ``--decoupled-lr``.

    Raises:
        ConfigError: ``--decoupled-min-lr`` alone (Megatron-LM ignores it silently), a minimum
            above the peak, or a peak below ``--lr-warmup-init``.
    """
    t, peak = cfg.training, cfg.optimizer.decoupled_lr
    if peak is None:
        if t.decoupled_min_lr is not None:
            raise ConfigError(f"--decoupled-min-lr {t.decoupled_min_lr} applies with "
                              "--decoupled-lr only: give --decoupled-lr too, or drop it")
        return None, None
    low = t.min_lr if t.decoupled_min_lr is None else t.decoupled_min_lr
    if low > peak or t.lr_warmup_init > peak:
        raise ConfigError(f"need the decoupled minimum ({low}: --decoupled-min-lr, default "
                          f"--min-lr) and --lr-warmup-init ({t.lr_warmup_init}) <= "
                          f"--decoupled-lr ({peak})")
    return peak, low


def _weight_decay_range(cfg: PretrainConfig) -> tuple[float, float]:
    t = cfg.training
    if t.weight_decay_incr_style == "constant":
        if t.start_weight_decay is not None or t.end_weight_decay is not None:
            raise ConfigError("--start-weight-decay / --end-weight-decay need "
                              "--weight-decay-incr-style linear or cosine (constant uses "
                              f"--weight-decay {cfg.optimizer.weight_decay})")
        return cfg.optimizer.weight_decay, cfg.optimizer.weight_decay
    if t.start_weight_decay is None or t.end_weight_decay is None:
        raise ConfigError(f"--weight-decay-incr-style {t.weight_decay_incr_style} needs "
                          "--start-weight-decay and --end-weight-decay")
    if t.start_weight_decay > t.end_weight_decay:
        raise ConfigError(f"need --start-weight-decay {t.start_weight_decay} <= "
                          f"--end-weight-decay {t.end_weight_decay}")
    return t.start_weight_decay, t.end_weight_decay


def build_schedule(s: dict) -> ParamSchedule:
    """The :class:`hybrid.schedule.ParamSchedule` of settings ``s``."""
    lr = LRSchedule(s["max_lr"], s["min_lr"], s["lr_warmup_steps"], s["lr_decay_steps"],
                    s["lr_decay_style"], s["init_lr"], s["wsd_decay_steps"],
                    s["lr_wsd_decay_style"])
    wd = WeightDecaySchedule(s["start_wd"], s["end_wd"], s["wd_incr_steps"], s["wd_incr_style"])
    decoupled = None
    if s.get("decoupled_lr") is not None:  # the same shape, its own peak and minimum
        decoupled = dataclasses.replace(lr, lr=s["decoupled_lr"], min_lr=s["decoupled_min_lr"])
    return ParamSchedule(lr, wd, decoupled)


def differences(saved: dict, ours: dict) -> list[str]:
    """``"--lr 0.003 -> 0.001"`` for each :data:`COMPARED` value that differs (those the
    checkpoint stores). Lengths that change no value are not compared (Megatron-LM compares them
    too, refusing every longer ``--train-iters``): the decay length and minimum of the constant
    style, and the increment length of a constant weight decay."""
    ignored = set()
    if saved.get("lr_decay_style") == ours["lr_decay_style"] == "constant":
        ignored |= {"lr_decay_steps", "min_lr"}
    if saved.get("wd_incr_style") == ours["wd_incr_style"] == "constant":
        ignored.add("wd_incr_steps")
    return [f"{LABELS[k]} {saved[k]} -> {ours[k]}" for k in COMPARED
            if k in saved and k not in ignored and saved[k] != ours[k]]


def resumed_settings(ours: dict, saved: dict | None, use_checkpoint: bool) -> dict:
    """The settings a resumed run follows: the checkpoint's :data:`COMPARED` values with
    ``use_checkpoint`` (warmup start and WSD settings stay this run's, as in Megatron-LM), else
    this run's (a difference was refused before, or overridden)."""
    if saved is None or not use_checkpoint:
        return ours
    return dict(ours, **{k: saved[k] for k in COMPARED if k in saved})


def saved_settings(meta: dict | None) -> dict | None:
    """The schedule settings of a checkpoint's ``metadata.json``; None when it has none.
    Checkpoints written before the schedule was Megatron-LM's stored iteration counts
    (``warmup_iters``, ``decay_iters``, ``style``) at a fixed global batch: converted with the
    checkpoint's own (consumed samples / iterations)."""
    saved = (meta or {}).get("lr_schedule")
    if saved is None or "max_lr" in saved:
        return saved
    gbs = meta["train_state"]["consumed_samples"] // max(1, meta["iteration"])
    return dict(max_lr=saved["lr"], min_lr=saved["min_lr"],
                lr_warmup_steps=saved["warmup_iters"] * gbs,
                lr_decay_steps=saved["decay_iters"] * gbs, lr_decay_style=saved["style"])
