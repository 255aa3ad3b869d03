"""What the job says before it trains, on rank 0: the notes on its flags that come before any
process group (:func:`print_notes`: wandb's names checked, Megatron-LM flags accepted without
effect, the default ZeRO stage, a sequence parallelism, ZeRO++ quantizer or profiling flag
without effect, a ``--split`` without validation data, ``--init-from-hf``'s model flags and
dropout), and the run's one-line setup (:func:`header`), which the run and the dry run print first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from data.split import no_validation_note
from hybrid.job.megatron_flags import default_stage_note
from hybrid.torch_profile import profile_notes
from hybrid.wandb_names import preflight as wandb_preflight

if TYPE_CHECKING:
    from hybrid.config import PretrainConfig
    from hybrid.job.config_checks import Job


def header(job: Job) -> str:
    """The run's one-line setup: grid, batch, model, ZeRO stage and precision, and the
    activation-memory options (sequence parallelism, recompute, ZeRO-R P_a / cpu / MD)."""
    cfg = job.cfg
    a = cfg.activation
    act = ["sequence parallel" + (" (TP comm overlapped)" if cfg.grid.tp_comm_overlap else "")
           ] if cfg.grid.sequence_parallel_active else []
    if a.selective_recompute:
        act.append("selective recompute")
    elif a.checkpoint_activations:
        n = a.first_blocks
        act.append("full recompute" + (f" of the first {n} blocks" if n else ""))
        act += [name for name, on in (("Pa", a.partition_activations), ("cpu", a.checkpoint_in_cpu),
                                      ("contiguous", a.contiguous_checkpointing)) if on]
    return (f"{job.summary()} | ZeRO-{cfg.zero.stage} {cfg.zero.precision} | activations: "
            f"{' + '.join(act) or 'all kept'}")


def quantizers_note(cfg: PretrainConfig, dp: int) -> str | None:
    """The note for ZeRO++'s quantized collectives at data-parallel size ``dp`` 1, where there is
    no ZeRO gather or reduce-scatter to quantize (the run trains bitwise as without them), or
    None."""
    on = [flag for flag, set_ in (("--zero-quantized-weights", cfg.zero.quantized_weights),
                                  ("--zero-quantized-gradients", cfg.zero.quantized_gradients))
          if set_]
    if dp > 1 or not on:
        return None
    return (f"note: {' and '.join(on)} {'has' if len(on) == 1 else 'have'} no effect at "
            "data-parallel size 1 (no ZeRO gather or reduce-scatter to quantize: all ranks are "
            "one tensor-parallel group); the run trains as without")


def print_notes(cfg: PretrainConfig, job: Job, ignored: list[str], hf_flags: list[str],
                given: set[str]) -> None:
    """Print the notes on ``cfg``'s flags that come before any process group (see the module
    docstring; the caller prints them on rank 0 only). ``ignored``, ``hf_flags`` and ``given``:
    what :func:`hybrid.job.cli.parse_config` filled in (the Megatron-LM flags accepted without
    effect, the model flags of ``--init-from-hf``'s config.json, the flags given).

    Raises:
        ConfigError: wandb's project or entity refused online
            (:func:`hybrid.wandb_names.preflight`).
    """
    if not cfg.dry_run.dry_run_world_size:
        wandb_preflight(cfg.logging.wandb_project, cfg.logging.wandb_entity,
                        cfg.logging.wandb_init_timeout)  # online: refuse a foreign entity
    if ignored:
        print(f"hybrid-pretrain: Megatron-LM flags accepted without effect here (kernel, "
              f"fusion and backend choices): {', '.join(ignored)}", flush=True)
    if note := default_stage_note(given, job.dp):
        print(note, flush=True)
    if cfg.grid.sequence_parallel and not cfg.grid.sequence_parallel_active:
        print("hybrid-pretrain: note: --sequence-parallel has no effect at "
              "--tensor-model-parallel-size 1 (no group to split the sequence over); disabled, as "
              "Megatron-LM disables it", flush=True)
    notes = [quantizers_note(cfg, job.dp), *profile_notes(cfg.logging, cfg.training.train_iters),
             no_validation_note(cfg.data.split, cfg.eval.eval_iters)]
    for note in filter(None, notes):
        print(f"hybrid-pretrain: {note}", flush=True)
    if hf_flags:
        print(f"hybrid-pretrain: --init-from-hf {cfg.checkpoint.init_from_hf}: the model flags of "
              f"its config.json: {' '.join(hf_flags)}", flush=True)
    if cfg.checkpoint.init_from_hf:
        from hybrid.hf.weights import start_note  # the run's dropout against config.json's

        note = start_note(cfg.checkpoint.init_from_hf, job.gpt)
        if note:
            print(note, flush=True)
