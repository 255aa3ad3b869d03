"""Loss scaling for fp16 training: a static scale or the dynamic state machine.

Dynamic rules (loss scaling: Micikevicius et al. 2018, arXiv 1710.03740 §3.2; the dynamic rules
are the ones DeepSpeed users know):

- every step the caller reports whether the (world-reduced) gradients overflowed;
- overflow: the step is skipped. If ``hysteresis`` overflows have now been seen since the last
  refill, the scale is halved (never below ``min_scale``); otherwise one unit of hysteresis is
  used up and the scale stays;
- a clean step: after ``window`` consecutive clean steps since the last overflow the scale
  doubles and the hysteresis is refilled.

The state is plain numbers (:meth:`state_dict`), never a pickled object.
"""

from __future__ import annotations


class LossScaler:
    """Args:
        scale: initial scale (``ZeroConfig.initial_loss_scale``) or the static scale.
        dynamic: update the scale from overflows; a static scaler still reports them.
        window, hysteresis, min_scale: see the module docstring.
    """

    def __init__(self, scale: float, dynamic: bool, window: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0):
        self.scale = float(scale)
        self.dynamic = dynamic
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.hysteresis_left = hysteresis
        self.clean_steps = 0
        """Clean steps since the last overflow or the last growth."""

    def update(self, overflow: bool) -> None:
        """Advance the state machine after one optimizer step (skipped or not)."""
        if not self.dynamic:
            return
        if overflow:
            self.clean_steps = 0
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.hysteresis_left -= 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.window:
            self.scale *= 2.0
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return dict(scale=self.scale, dynamic=self.dynamic, window=self.window,
                    hysteresis=self.hysteresis, min_scale=self.min_scale,
                    hysteresis_left=self.hysteresis_left, clean_steps=self.clean_steps)

    def load_state_dict(self, state: dict) -> None:
        """Continue a saved dynamic scaler's state: its scale (not below this run's minimum),
        hysteresis left (at most this run's hysteresis) and clean steps. The settings stay this
        run's flags, as in Megatron-LM's ``DynamicGradScaler.load_state_dict``: static or dynamic,
        window, hysteresis, minimum. A static scaler keeps its scale, and a dynamic one resuming
        a checkpoint whose scaler was not dynamic (fp32, bf16, a static fp16 scale) starts at
        its own initial scale.

        Args:
            state: a :meth:`state_dict` (from a checkpoint's JSON metadata).
        """
        if not (self.dynamic and state.get("dynamic")):
            return
        self.scale = max(float(state["scale"]), self.min_scale)
        self.hysteresis_left = max(1, min(int(state["hysteresis_left"]), self.hysteresis))
        self.clean_steps = min(int(state["clean_steps"]), self.window - 1)
