"""``hybrid-pretrain --nproc-per-node N [torchrun options] [flags]``: validate, then torchrun.

The launcher checks the configuration once, in this process, for the world it is about to
start (``--nnodes`` x ``--nproc-per-node`` ranks): a bad flag is one error line and exit status
2, before any worker or process group exists. Only then does it run torchrun
(``python -m torch.distributed.run``) with the same options and ``-m hybrid.pretrain`` and the
remaining flags, and it returns torchrun's exit status.

Signals. A stop (SIGTERM from SLURM or ``kill``, SIGINT from Ctrl-C) must reach the workers and
nothing else: each worker finishes its iteration, saves and exits 0
(:mod:`hybrid.job.preemption`), however long the save takes. torchrun, left to itself,
forwards such a signal, waits its shutdown timeout (30 s) and SIGKILLs workers that are still
saving, then exits 1. So torchrun is started with SIGTERM and SIGINT ignored (a disposition it
keeps, because ``--signals-to-handle`` here names neither) and this launcher forwards them to
torchrun's workers (which torchrun starts in sessions of their own, out of reach of the
terminal's Ctrl-C). SLURM, which signals every process of the job step, then reaches the
launcher, torchrun and the workers at once: torchrun ignores it, each worker sees a stop (once
or twice, the same stop). A second Ctrl-C (more than :data:`REPEAT_S` after the first; a
repeat within it is the same Ctrl-C delivered twice) SIGKILLs torchrun and its workers at once,
prints one line that says which checkpoint stays, and exits 130; once the workers have ended
(their stop's save done), a Ctrl-C changes nothing. A stop before torchrun starts (during the
check) starts nothing: one line, exit status 0. A stop after that, before the workers catch it
(they inherit torchrun's ignored SIGTERM/SIGINT until their entry point installs its handler),
is kept and sent to each worker once it catches it: it is honoured after the first iteration.

A launcher that dies without a word (SIGKILL: the OOM killer, ``kill -9``) takes torchrun with
it: the kernel SIGKILLs torchrun when its parent dies (``prctl(PR_SET_PDEATHSIG)``, set in the
child before it runs torchrun), and the workers, which die with torchrun
(:func:`hybrid.job.preemption.stop_with_parent`), stop as on SIGTERM: finish the iteration,
save, exit 0 (SIGKILL while they start: nothing to save yet). Nothing of the job trains on
orphaned, and ``--save``'s lock is released (or, left by a killed rank 0, stale).

``--save``'s lock: :mod:`hybrid.job.save_claim` (taken here for a one-node job, so that of two
jobs started at the same moment the second is refused before any worker exists).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time

from hybrid.checkpoint.directory import IncompleteCheckpointError, latest_iteration
from hybrid.checkpoint.lock import SaveDirectoryInUseError
from hybrid.job.cli import LAUNCH_OPTIONS, parse_config
from hybrid.job.config_checks import ConfigError, validate
from hybrid.job.preemption import REPEAT_S, early_stop
from hybrid.job.save_claim import hold_save, worker_env

# what torchrun itself still handles (forwarded to the workers, which then end at once)
TORCHRUN_SIGNALS = "SIGHUP,SIGQUIT"
STATUS_FILE_ENV = "HYBRID_LAUNCH_STATUS_FILE"
"""Where the launcher's workers write the status of a failure they reported themselves."""


def split_launch_options(argv: list[str]) -> tuple[dict[str, str | None], list[str]]:
    """``(torchrun options, hybrid.pretrain flags)`` of ``argv``. torchrun's ``_`` spellings
    (``--nproc_per_node``) and ``--flag=value`` are accepted; ``None`` for ``--standalone``.

    Raises:
        ConfigError: a launcher option without its value.
    """
    options: dict[str, str | None] = {}
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        flag = name.replace("_", "-") if name.startswith("--") else name
        if flag not in LAUNCH_OPTIONS:
            rest.append(arg)
            continue
        if LAUNCH_OPTIONS[flag] and not eq:
            value = next(args, None)
            if value is None or value.startswith("--"):
                raise ConfigError(f"{flag} needs a value (torchrun's option)")
        options[flag] = value if LAUNCH_OPTIONS[flag] else None
    return options, rest


def wanted(argv: list[str]) -> bool:
    """True when ``argv`` asks this process to launch torchrun (``--nproc-per-node``), outside
    torchrun.

    Raises:
        ConfigError: a launcher option given to a process that torchrun already started.
    """
    options, _ = split_launch_options(argv)
    if not options:
        return False
    if "TORCHELASTIC_RUN_ID" in os.environ:
        raise ConfigError(f"{' '.join(options)}: torchrun already started this process; give "
                          "torchrun's options to torchrun, or run hybrid-pretrain "
                          "--nproc-per-node N without torchrun")
    if "--nproc-per-node" not in options:
        raise ConfigError(f"{' '.join(options)} launches torchrun: add --nproc-per-node N "
                          "(processes per node)")
    return True


def world_of(options: dict[str, str | None]) -> tuple[int, int]:
    """``(world size, processes per node)`` that ``options`` start (``--nnodes MIN:MAX``: MAX).

    Raises:
        ConfigError: a value that is not a positive number (``gpu``/``auto``: the GPU count).
    """
    nproc, nnodes = options["--nproc-per-node"], options.get("--nnodes") or "1"
    if nproc in ("gpu", "auto"):
        import torch

        nproc = str(torch.cuda.device_count() or (os.cpu_count() if nproc == "auto" else 0))
    try:
        per_node, nodes = int(nproc), int(nnodes.split(":")[-1])
    except ValueError:
        per_node = nodes = 0
    if per_node < 1 or nodes < 1:
        raise ConfigError(f"--nproc-per-node {options['--nproc-per-node']} --nnodes {nnodes}: "
                          "give positive numbers of processes per node and of nodes")
    return per_node * nodes, per_node


def torchrun_command(options: dict[str, str | None], flags: list[str],
                     module: str = "hybrid.pretrain") -> list[str]:
    """The torchrun command line: ``options``, the signals it keeps handling, then
    ``-m module flags``. One node without a rendezvous address runs ``--standalone`` (a free
    port, so two jobs on one machine do not collide)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--signals-to-handle", TORCHRUN_SIGNALS]
    for flag, value in options.items():
        cmd += [flag] if value is None else [flag, value]
    addressed = {"--master-addr", "--master-port", "--rdzv-endpoint", "--standalone"}
    if (options.get("--nnodes") or "1") == "1" and not addressed & options.keys():
        cmd.append("--standalone")
    return cmd + ["-m", module, *flags]


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux ``/proc``; empty elsewhere)."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                found.append(int(entry))
    return found


def _ignore_stops() -> None:
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)


def _torchrun_start(launcher: int):
    """What torchrun's process runs after the fork, before torchrun itself: ignore SIGTERM and
    SIGINT (the launcher forwards them) and die with the launcher ``launcher`` (Linux
    ``PR_SET_PDEATHSIG`` with SIGKILL; SIGTERM would be ignored). A launcher that died during
    the fork ends the child at once."""
    def start() -> None:
        _ignore_stops()
        if not sys.platform.startswith("linux"):
            return
        try:
            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != launcher:
            os._exit(128 + signal.SIGKILL)
    return start


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def published(save: str) -> int | None:
    """The iteration of ``save``'s published checkpoint (None: none, or an unreadable
    pointer)."""
    try:
        return latest_iteration(save)
    except IncompleteCheckpointError:
        return None


def ended_line(why: str, save: str | None, before: int | None) -> str:
    """The one line printed when the launcher ends every process at once, true to what stays:
    ``save`` is ``--save`` (None: none), ``before`` its published iteration when the stop came.
    """
    head = f"hybrid-pretrain: {why}: ended every process now"
    if not save:
        return f"{head}; nothing was saved (no --save)"
    latest = published(save)
    if latest is not None and latest != before:
        return (f"{head}, after the stop's save had completed: the checkpoint at iteration "
                f"{latest} in {save} stays")
    if latest is not None:
        return (f"{head}, without saving: the last saved checkpoint stays (iteration {latest} in "
                f"{save})")
    return f"{head}, without saving: {save} holds no checkpoint"


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux ``/proc``: ``SigCgt``; True
    elsewhere). A worker inherits torchrun's ignored SIGTERM/SIGINT until its entry point
    installs its handler (:func:`hybrid.job.preemption.catch_stops_early`): a stop sent before
    that would be lost."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return bool(int(fields["SigCgt"], 16) >> (signum - 1) & 1)
    except (OSError, KeyError, ValueError):
        return not os.path.isdir("/proc")


class _Forward:
    """The launcher's SIGTERM / SIGINT handler: pass the stop to torchrun's workers; a second
    SIGINT (more than :data:`REPEAT_S` after the last: sooner, it is the same Ctrl-C delivered
    twice) ends torchrun and the workers at once. A stop before a worker catches it (torchrun
    or the workers still starting) is kept and sent to each worker once its handler exists
    (:meth:`deliver`), so it is honoured after the first iteration. Once the workers have
    ended, torchrun ends by itself and a signal changes nothing.

    Args:
        proc: torchrun.
        save: the job's ``--save`` (None: none), for the line that says what stays.
        clock: seconds, monotonic (tests pass their own).
        workers: how many workers torchrun starts on this node.
    """

    def __init__(self, proc: subprocess.Popen, save: str | None = None, clock=time.monotonic,
                 workers: int = 1):
        self.proc, self.interrupts, self.started = proc, 0, False
        self.save, self.clock, self.last_interrupt = save, clock, None
        self.before: int | None = None  # --save's published iteration when the stop came
        self.stopping = False
        self.expected, self.pending, self.sent = workers, None, set()

    def watch(self) -> None:
        """Note once that torchrun's workers exist (afterwards, no worker means they ended)."""
        self.started = self.started or bool(children(self.proc.pid))

    def waiting(self) -> bool:
        """True while the workers have not started, or a kept stop has not reached them all."""
        return not self.started or (self.pending is not None and len(self.sent) < self.expected)

    def deliver(self, workers: list[int] | None = None) -> None:
        """Send the kept stop to each worker that catches it now and has not had it."""
        workers = children(self.proc.pid) if workers is None else workers
        self.started = self.started or bool(workers)
        if self.pending is None:
            return
        ready = [w for w in workers if w not in self.sent and catches(w, self.pending)]
        if ready:
            self.sent.update(ready)
            _kill(ready, self.pending)

    def __call__(self, signum, frame) -> None:
        workers = children(self.proc.pid)
        self.started = self.started or bool(workers)
        if signum == signal.SIGINT:
            now, last = self.clock(), self.last_interrupt
            self.last_interrupt = now
            if last is not None and now - last <= REPEAT_S:
                return  # the same Ctrl-C again: the workers have it already
            self.interrupts += 1
        if self.started and not workers:
            return  # the workers ended (saved or not): torchrun is ending by itself
        if self.interrupts < 2:
            if not self.stopping and self.save:
                self.before = published(self.save)
            self.stopping = True
            if self.pending is None:
                self.pending = signum
            self.deliver(workers)
            return
        _kill([self.proc.pid, *workers], signal.SIGKILL)
        print(ended_line("second interrupt", self.save, self.before), file=sys.stderr,
              flush=True)
        os._exit(128 + signum)


def worker_status(status: int) -> int:
    """The exit status a worker gives torchrun for ``status``, its job's (non-zero: a failure
    already reported in one line, such as a failed save). Under this launcher (its status file
    in :data:`STATUS_FILE_ENV`) the worker appends ``status`` to the file and exits 0, so that
    torchrun ends without its ``ChildFailedError`` report and the launcher exits with
    ``status`` (:func:`supervise`). Without the launcher (plain torchrun, whose report then
    follows), or when the file cannot be written, ``status`` itself."""
    path = os.environ.get(STATUS_FILE_ENV)
    if not status or not path:
        return status
    try:
        with open(path, "a") as f:
            f.write(f"{status}\n")
    except OSError:  # a full disk there too: torchrun's report, but the right status
        return status
    return 0


def _reported(path: str) -> int:
    """The largest status the workers wrote to ``path`` (0: none), and the file removed."""
    try:
        with open(path) as f:
            codes = [int(w) for w in f.read().split() if w.isdigit()]
        os.unlink(path)
    except OSError:
        return 0
    return max(codes, default=0)


def supervise(cmd: list[str], save: str | None = None, workers: int = 1,
              handed_over: bool = True, env_extra: dict[str, str] | None = None) -> int:
    """Run torchrun ``cmd`` with SIGTERM/SIGINT ignored, forwarding them to its ``workers``
    workers, and dying with this process; returns its exit status (128 + n when signal n
    killed it), or, when torchrun succeeded, the status of a failure the workers reported
    themselves (:func:`worker_status`; ``handed_over`` False: the workers exit with it, as
    torchrun must see a failure to restart them under ``--max-restarts``). ``save``: the
    job's ``--save``; ``env_extra``: more environment for torchrun and its workers (the
    lock's hand-over token). A stop that came before
    (:func:`hybrid.job.preemption.early_stop`) is kept for the workers."""
    env = dict(os.environ, **(env_extra or {}))
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default too, without its warning
    env.pop(STATUS_FILE_ENV, None)
    if not handed_over:
        return _run(cmd, env, save, workers)
    fd, env[STATUS_FILE_ENV] = tempfile.mkstemp(prefix="hybrid-launch-status-")
    os.close(fd)
    status = _run(cmd, env, save, workers)
    reported = _reported(env[STATUS_FILE_ENV])
    return status or reported


def _run(cmd: list[str], env: dict, save: str | None, workers: int) -> int:
    """torchrun's exit status (:func:`supervise`'s loop)."""
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_torchrun_start(os.getpid()))
    forward = _Forward(proc, save, workers=workers)
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    if early_stop() is not None:  # between the launcher's check and the handler above
        forward(early_stop(), None)
    try:
        while proc.poll() is None:
            if forward.waiting():
                forward.deliver()
                time.sleep(0.1)
                continue
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        status = proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 128 - status if status < 0 else status


def launch(argv: list[str], module: str = "hybrid.pretrain") -> int:
    """Validate ``argv``'s flags for the world its launcher options start, then run torchrun;
    returns the exit status (2: refused before torchrun starts, for a configuration error or a
    live job holding ``--save``'s lock; one line)."""
    try:
        options, flags = split_launch_options(argv)
        world, per_node = world_of(options)
        cfg = parse_config(flags)
        validate(cfg, world_size=world, local_world_size=per_node)
    except ConfigError as e:
        print(f"hybrid-pretrain: error: {e}", file=sys.stderr)
        return 2
    try:
        lock = hold_save(cfg.checkpoint.save, world == per_node)
    except (SaveDirectoryInUseError, OSError) as e:
        why = e if isinstance(e, SaveDirectoryInUseError) else f"cannot lock --save: {e}"
        print(f"hybrid-pretrain: error: {why}", file=sys.stderr)  # as rank 0 would
        return 2
    try:
        if early_stop() is not None:  # before any worker exists: nothing to stop or save
            name = signal.Signals(early_stop()).name
            print(f"hybrid-pretrain: received {name} before torchrun started: no process was "
                  "started, nothing to save", file=sys.stderr, flush=True)
            return 0
        restarts = (options.get("--max-restarts") or "0") != "0"  # torchrun restarts failures
        return supervise(torchrun_command(options, flags, module), cfg.checkpoint.save,
                         per_node, handed_over=not restarts, env_extra=worker_env(lock))
    finally:
        if lock is not None:
            lock.release()
