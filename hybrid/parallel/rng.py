"""Random-number streams for tensor parallelism (Megatron-LM paper, Appendix B.2).

Dropout outside tensor-parallel regions (embeddings, residual branches) must draw identical
masks on every TP rank, so the default generator is seeded identically across the TP group.
Dropout inside TP regions (attention probabilities, whose heads are split) must differ per TP
rank: it draws from a separate stream seeded ``seed + 2718 + tp_rank`` that
:meth:`RNGTracker.fork` swaps in for the duration of a block.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

TP_SEED_OFFSET = 2718


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Holds the tensor-parallel RNG stream of one rank, for one device type.

    Args:
        seed: the job's seed (same on every rank).
        tp_rank: this rank's tensor-parallel rank; the TP stream is seeded
            ``seed + 2718 + tp_rank``.
        device: device whose generator the stream replaces inside :meth:`fork`.
    """

    def __init__(self, seed: int, tp_rank: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.seed = seed
        self.tp_rank = tp_rank
        saved = _get_state(self.device)
        gen_seed = seed + TP_SEED_OFFSET + tp_rank
        if self.device.type == "cuda":
            # torch.cuda.manual_seed seeds the *current* device: make it this tracker's, whose
            # state is read and restored here and in fork()
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(gen_seed)
        else:
            torch.manual_seed(gen_seed)
        self._state = _get_state(self.device)
        _set_state(saved, self.device)

    @contextlib.contextmanager
    def fork(self):
        """Run the body with the TP stream as the device's default generator, then restore."""
        outer = _get_state(self.device)
        _set_state(self._state, self.device)
        try:
            yield
        finally:
            self._state = _get_state(self.device)
            _set_state(outer, self.device)

    def get_state(self) -> torch.Tensor:
        """The TP stream's state (a uint8 tensor), for checkpoints and recompute."""
        return _host_clone(self._state)

    def set_state(self, state: torch.Tensor) -> None:
        """Restore the TP stream from :meth:`get_state`."""
        self._state = _host_clone(state)


def _host_clone(state: torch.Tensor) -> torch.Tensor:
    # Generator states are real host bytes even under a fake-tensor mode (the dry run), where
    # a plain clone would give a tensor without data that no generator accepts.
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return state.clone()


def seed_everything(seed: int, device: torch.device | str = "cpu") -> None:
    """Seed Python, numpy and torch (CPU and CUDA) identically on every rank."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.device(device).type == "cuda":
        torch.cuda.manual_seed_all(seed)


def capture_torch_rng(tracker: RNGTracker | None,
                      device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The generators a forward on ``device`` can draw from: torch CPU, CUDA of ``device`` (on
    GPU) and the TP tracker's stream (activation recompute replays them)."""
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.device(device).type == "cuda":
        out["torch_cuda"] = torch.cuda.get_rng_state(device)
    if tracker is not None:
        out["tp_tracker"] = tracker.get_state()
    return out


def restore_torch_rng(states: dict[str, torch.Tensor], tracker: RNGTracker | None,
                      device: torch.device | str = "cpu") -> None:
    """Inverse of :func:`capture_torch_rng`."""
    torch.set_rng_state(states["torch_cpu"])
    if "torch_cuda" in states and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(states["torch_cuda"], device)
    if tracker is not None and "tp_tracker" in states:
        tracker.set_state(states["tp_tracker"])


def capture_rng_states(tracker: RNGTracker | None,
                       device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every RNG state of this rank as tensors (for a checkpoint shard): Python, numpy,
    torch CPU, CUDA (on GPU) and the TP tracker's stream."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    out = {
        "python": torch.tensor([py_version, *py_state], dtype=torch.int64),
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "numpy_extra": torch.tensor([np_pos, np_has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_gauss], dtype=torch.float64),
        **capture_torch_rng(tracker, device),
    }
    if py_gauss is not None:
        out["python_gauss"] = torch.tensor([py_gauss], dtype=torch.float64)
    return out


def restore_rng_states(states: dict[str, torch.Tensor], tracker: RNGTracker | None,
                       device: torch.device | str = "cpu") -> None:
    """Inverse of :func:`capture_rng_states`."""
    py = states["python"].tolist()
    gauss = states["python_gauss"].item() if "python_gauss" in states else None
    random.setstate((py[0], tuple(py[1:]), gauss))
    pos, has_gauss = states["numpy_extra"].tolist()
    np.random.set_state(("MT19937", states["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss,
                         states["numpy_gauss"].item()))
    restore_torch_rng(states, tracker, device)
