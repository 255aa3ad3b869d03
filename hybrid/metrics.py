"""One metrics path: a human log line, a JSONL record and wandb, same numbers.

Only global rank 0 writes anything. The log line follows Megatron-LM's field order; the JSON
record keeps full float precision; the resolved config goes beside the JSONL file
(:func:`config_path`) and to wandb. wandb is optional: without the package, or when it fails to
start, training goes on with a warning; with no credentials it runs offline (no network); when
its server cannot be reached within ``--wandb-init-timeout`` it falls back to offline mode.
Every launch appends to the JSONL file, with its first record a ``{"kind": "start",
"iteration": k}`` record (k: the iteration it resumed from, 0 for a fresh run; a launch that
logs nothing writes none), so nothing an earlier launch wrote is lost; readers
(:func:`hybrid.plot_metrics.read_metrics`) drop the records after k that came before the
marker: a resumed job's file reads as its own history, and a fresh run reusing the file does
not inherit an older run's later iterations.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import warnings
from pathlib import Path

import torch

TRAIN_FIELDS = ("iteration", "consumed_samples", "lm_loss", "lr", "grad_norm", "loss_scale",
                "skipped_iterations", "nan_iterations", "elapsed_ms", "eta_s", "tokens_per_sec",
                "tflops_per_device")


def memory_mb(device: torch.device) -> float:
    """Peak memory of this process in MB (2**20 bytes): CUDA max allocated, else peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def interval_memory(device: torch.device) -> dict[str, float]:
    """The log record's memory fields, in MB (2**20 bytes), then a new interval begins.

    ``memory_mb``: peak allocated since the last call (CUDA; on CPU the process's peak RSS,
    which cannot be reset); ``memory_reserved_mb`` (CUDA only): peak reserved by the caching
    allocator since the last call, so fragmentation shows as reserved minus allocated. On CUDA
    the peak counters are reset after reading.
    """
    out = dict(memory_mb=memory_mb(device))
    if device.type == "cuda":
        out["memory_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
    return out


def format_eta(seconds: float) -> str:
    """``H:MM:SS`` (``Nd H:MM:SS`` beyond a day) of a duration in seconds, rounded to the
    second."""
    s = max(0, round(seconds))
    days, s = divmod(s, 86400)
    text = f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{days}d {text}" if days else text


def format_train_line(r: dict, train_iters: int) -> str:
    """Megatron-LM's log line for a training record ``r``, with the ETA after the iteration
    time when ``r`` has ``eta_s`` (seconds: the remaining iterations times the log window's time
    per iteration, plus the remaining evaluations at the measured time of one; before one has
    run, ``eta_evaluations`` says how many it leaves out: ``ETA: 0:00:01 + 4 evaluations``)."""
    parts = [
        f" iteration {r['iteration']:8d}/{train_iters:8d}",
        f"consumed samples: {r['consumed_samples']:12d}",
        f"elapsed time per iteration (ms): {r['elapsed_ms']:.1f}",
    ]
    if r.get("eta_s") is not None:
        evals = r.get("eta_evaluations")
        more = f" + {evals} evaluation{'s' * (evals > 1)}" if evals else ""
        parts.append(f"ETA: {format_eta(r['eta_s'])}{more}")
    parts += [
        f"learning rate: {r['lr']:.6E}",
        *([f"decoupled learning rate: {r['decoupled_lr']:.6E}"] if "decoupled_lr" in r else []),
        f"global batch size: {r['global_batch_size']:5d}",
        f"lm loss: {r['lm_loss']:.6E}",
        f"loss scale: {r['loss_scale']:.1f}",
        f"grad norm: {r['grad_norm']:.3f}",
        f"number of skipped iterations: {r['skipped_iterations']:3d}",
        f"number of nan iterations: {r['nan_iterations']:3d}",
        f"tokens per second: {r['tokens_per_sec']:.1f}",
        f"TFLOP/s per device: {r['tflops_per_device']:.3f}",
    ]
    if r.get("mfu") is not None:
        parts.append(f"MFU: {100 * r['mfu']:.1f}%")
    parts.append(f"memory (MB): {r['memory_mb']:.0f}")
    if r.get("memory_reserved_mb") is not None:
        parts.append(f"reserved (MB): {r['memory_reserved_mb']:.0f}")
    return " | ".join(parts) + " |"


def format_eval_line(r: dict) -> str:
    ppl = math.exp(min(20.0, r["lm_loss"]))
    return (f" {r['split']} loss at iteration {r['iteration']} | lm loss value: {r['lm_loss']:.6E} "
            f"| lm loss PPL: {ppl:.6E} |")


class MetricsWriter:
    """Writes records on global rank 0; a no-op object on every other rank.

    Args:
        rank: global rank.
        metrics_file: JSONL path or None.
        config: resolved config dict (for wandb).
        wandb_project, wandb_exp_name, wandb_save_dir: wandb settings; no project, no wandb.
        print_fn: where log lines go (``print`` or a progress bar's ``write``).
        start_iteration: the iteration this launch starts from (0 fresh, else the loaded
            checkpoint's); written as the file's ``start`` record.
    """

    def __init__(self, rank: int, metrics_file: str | None, config: dict,
                 wandb_project: str | None = None, wandb_exp_name: str | None = None,
                 wandb_save_dir: str | None = None, print_fn=print,
                 wandb_init_timeout: float = 30.0, wandb_run_id: str | None = None,
                 start_iteration: int = 0, wandb_entity: str | None = None):
        self.active = rank == 0
        self.print = print_fn
        self._file = None
        self._created: Path | None = None  # the metrics file, when this writer created it
        self._start: dict | None = None  # written before this launch's first record
        self._wandb = None
        self.config_file: Path | None = None
        if not self.active:
            return
        if metrics_file:
            Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
            # a record cut short by a crash stays its own line
            torn = _ends_without_newline(metrics_file)
            self._created = None if os.path.exists(metrics_file) else Path(metrics_file)
            self._file = open(metrics_file, "a", buffering=1)
            if torn:
                self._file.write("\n")
            self._start = {"kind": "start", "iteration": start_iteration}
            self.config_file = config_path(metrics_file)
            self.config_file.write_text(json.dumps(config, indent=2, default=str) + "\n")
        if wandb_project:
            self._wandb = _start_wandb(wandb_project, wandb_exp_name, wandb_save_dir, config,
                                       wandb_init_timeout, wandb_run_id, wandb_entity)

    @property
    def wandb_run_id(self) -> str | None:
        """The wandb run's id (stored with each checkpoint so a resumed job continues the run)."""
        return None if self._wandb is None else self._wandb.id

    def train(self, record: dict, train_iters: int) -> None:
        """Log one training record (must hold :data:`TRAIN_FIELDS`)."""
        if not self.active:
            return
        self.print(format_train_line(record, train_iters))
        self._write({"kind": "train", **record}, step=record["iteration"])

    def eval(self, record: dict) -> None:
        """Log one evaluation record (``split``, ``iteration``, ``lm_loss``)."""
        if not self.active:
            return
        self.print(format_eval_line(record))
        self._write({"kind": "eval", **record}, step=record["iteration"],
                    wandb_prefix=f"{record['split']}/")

    def _write(self, record: dict, step: int, wandb_prefix: str = "") -> None:
        if self._file:
            if self._start is not None:
                self._file.write(json.dumps(self._start) + "\n")
                self._start = None
            self._file.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            try:
                self._wandb.log({wandb_prefix + k: v for k, v in record.items()
                                 if isinstance(v, int | float) and not isinstance(v, bool)},
                                step=step)
            except Exception as e:  # tracking must never stop training
                warnings.warn(f"wandb.log failed, disabling wandb: {e}", stacklevel=2)
                self._wandb = None

    def close(self) -> None:
        """Close the file (removed when this writer created it and the run ended before its
        first record: a stop before the first log line leaves no empty file) and wandb."""
        if self._file:
            self._file.close()
            self._file = None
            if self._created is not None and self._start is not None:
                self._created.unlink(missing_ok=True)
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as e:
                warnings.warn(f"wandb.finish failed: {e}", stacklevel=2)
            self._wandb = None


def _ends_without_newline(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


def wandb_mode() -> str:
    """``WANDB_MODE`` if set; else ``online`` with credentials (``WANDB_API_KEY`` or a netrc
    entry for api.wandb.ai), otherwise ``offline`` so that no network is ever attempted."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        if "api.wandb.ai" in netrc.read_text():
            return "online"
    except OSError:
        pass
    return "offline"


def config_path(metrics_file: str | Path) -> Path:
    """Where the resolved config is written beside ``metrics_file`` (``m.jsonl`` ->
    ``m.config.json``)."""
    p = Path(metrics_file)
    return p.with_name(p.stem + ".config.json")


def _start_wandb(project, name, save_dir, config, init_timeout: float = 30.0,
                 run_id: str | None = None, entity: str | None = None):
    """``wandb.init`` with ``init_timeout`` seconds to reach the server; when it cannot (no
    network, server down), the same run is started in offline mode so that it is kept under
    ``save_dir`` for ``wandb sync``. ``run_id`` resumes that run (a resumed job). None when
    wandb is missing or cannot start at all."""
    try:
        import wandb
    except ImportError:
        warnings.warn("--wandb-project is set but wandb is not installed; continuing without it",
                      stacklevel=3)
        return None
    save_dir = save_dir or os.getcwd()
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    mode = wandb_mode()
    kwargs = dict(project=project, entity=entity, name=name, dir=save_dir, config=config, id=run_id,
                  resume="allow" if run_id else None)
    try:
        return wandb.init(mode=mode, settings=wandb.Settings(init_timeout=init_timeout,
                                                             console="off", silent=True),
                          **kwargs)
    except Exception as e:
        if mode != "online":
            print(f"warning: wandb failed to start ({e}); continuing without it", file=sys.stderr)
            return None
        print("warning: wandb could not reach its server within --wandb-init-timeout "
              f"{init_timeout:g} s ({str(e).splitlines()[0]}); logging offline under "
              f"{save_dir}/wandb instead (upload it later with `wandb sync`)", file=sys.stderr)
    try:
        return wandb.init(mode="offline", settings=wandb.Settings(console="off", silent=True),
                          **kwargs)
    except Exception as e:
        print(f"warning: wandb failed to start offline too ({e}); continuing without it",
              file=sys.stderr)
        return None
