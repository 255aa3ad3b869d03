"""The ``logging`` section of the pretraining config: metrics, tracking and profiling flags (a
section of :class:`hybrid.config.PretrainConfig`, in its own file for length)."""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.config_fields import arg, check_int, fail


@dataclass
class LoggingConfig:
    """Metrics and tracking."""

    log_interval: int = arg(100, "steps between log lines / metrics records")
    metrics_file: str | None = arg(None,
                                   "JSONL file with one record per logged step and evaluation")
    tensorboard_dir: str | None = arg(None, "write the metrics as TensorBoard events here "
                                             "(global rank 0)")
    wandb_project: str | None = arg(None, "wandb project (wandb is off when unset)")
    wandb_exp_name: str | None = arg(None, "wandb run name")
    wandb_save_dir: str | None = arg(None, "directory for wandb files (default: ./wandb)")
    wandb_entity: str | None = arg(None, "wandb entity (user or team) of the project (default: "
                                         "your user's); checked before training when online")
    profile_phases: bool = arg(False, "time each step's phases (forward, backward, grad comm, "
                               "optimizer, ...; hybrid.zero.profile) and log them as "
                               "phase_<name>_ms per step")
    profile: bool = arg(False, "write a torch.profiler trace of iterations --profile-step-start "
                               "to --profile-step-end - 1 (hybrid.torch_profile)")
    profile_step_start: int = arg(10, "first iteration --profile traces")
    profile_step_end: int = arg(12, "--profile traces up to the iteration before this one")
    use_pytorch_profiler: bool = arg(False, "Megatron-LM's switch from nsys to torch.profiler; "
                                            "--profile always writes a torch.profiler trace here "
                                            "(without it, CUDA also opens the nsys range)")
    profile_ranks: list[int] = arg([], "global ranks --profile traces (default: all)", nargs="*")

    def __post_init__(self) -> None:
        from hybrid.wandb_names import check_names

        check_int(self, "log_interval", 1)
        check_int(self, "profile_step_start", 1)
        check_int(self, "profile_step_end", 1)
        if self.profile and self.profile_step_end <= self.profile_step_start:
            fail(self, "profile_step_end", f"must be > --profile-step-start "
                 f"{self.profile_step_start} (the trace holds iterations start to end - 1)")
        check_names(self.wandb_project, self.wandb_entity)
    wandb_init_timeout: float = arg(30.0, "seconds wandb may take to reach its server before the "
                                          "run logs offline instead (upload later with `wandb "
                                          "sync`)")
