"""A stand-in for ZeRO-3's parameter life cycle on one block (for activation-checkpointing
tests run inside spawned ranks)."""

from __future__ import annotations

import torch


class FakeStage3:
    """ZeRO-3's parameter life cycle on one block, without data parallelism: parameters are
    emptied after the block's forward, restored in its forward pre-hook and before its backward."""

    def __init__(self, block):
        self.params = list(block.parameters())
        self.full = [p.detach().clone() for p in self.params]
        self.pre_calls = 0
        self.empty_at_backward = 0  # backward hooks that found the parameters released
        block.register_forward_pre_hook(self.pre)
        block.register_forward_hook(self.post)

    def gather(self):
        for p, f in zip(self.params, self.full, strict=True):
            p.data = f

    def release(self):
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype)

    def pre(self, module, args):
        self.pre_calls += 1
        self.gather()

    def before_backward(self, grad):
        self.empty_at_backward += all(p.numel() == 0 for p in self.params)
        self.gather()
        return grad

    def post(self, module, args, output):
        if output.requires_grad:
            output.register_hook(self.before_backward)
        self.release()
