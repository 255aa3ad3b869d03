"""Documents packed in one sequence: Megatron-LM's ``--reset-position-ids``,
``--reset-attention-mask`` and ``--eod-mask-loss`` (its ``_get_ltor_masks_and_position_ids``).

A sample is documents cut from a stream, each ended by the end-of-document token (eod). On the
inputs ``x`` ``[b, s]`` (the sample without its last token):

* a document ends at its eod: position ``p`` belongs to document ``#{q < p : x[q] = eod}``;
* ``--reset-position-ids``: positions restart at 0 after each eod (RoPE and learned positions);
* ``--reset-attention-mask``: ``p`` attends to ``q <= p`` of its own document only
  (block-causal attention);
* ``--eod-mask-loss``: the loss at positions whose input is the eod (predicting the next
  document's first token) is masked out.

:class:`Documents` carries the positions and document ids of a micro-batch to every attention
layer (through :class:`DocumentContext`, shared by the model's layers like its RoPE tables), and
builds the attention's block structure once per forward in the form the kernel wants
(:meth:`Documents.mask` ``[b, 1, s, s]`` for SDPA, :meth:`Documents.cu_seqlens` for varlen
flash attention).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Documents:
    """The document structure of a micro-batch ``[b, s]``.

    Attributes:
        position_ids: ``[b, s]`` int64 positions (restarting per document), or None (0..s-1).
        document_ids: ``[b, s]`` int64 document of each position for block-causal attention,
            or None (causal over the whole sequence).
    """

    position_ids: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    def to(self, device: torch.device, non_blocking: bool = False) -> Documents:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Documents(move(self.position_ids), move(self.document_ids))

    def mask(self) -> torch.Tensor:
        """``[b, 1, s, s]`` bool, True where query ``p`` may attend to key ``q``: ``q <= p`` in
        the same document (one mask per sequence, broadcast over heads; built once per forward
        and shared by the layers)."""
        if "mask" not in self._cache:
            d = self.document_ids
            s = d.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=d.device).tril()
            self._cache["mask"] = ((d[:, :, None] == d[:, None, :]) & causal)[:, None]
        return self._cache["mask"]

    def cu_seqlens(self) -> tuple[torch.Tensor, int]:
        """``(cu_seqlens int32 [N + 1], s)``: the starts of the ``N`` documents of the flattened
        ``[b * s]`` batch (a sequence's first token starts one too) and an upper bound of their
        length, for varlen flash attention. One device-to-host sync (the document count)."""
        if "cu" not in self._cache:
            d = self.document_ids
            b, s = d.shape
            start = torch.ones_like(d, dtype=torch.bool)
            start[:, 1:] = d[:, 1:] != d[:, :-1]
            starts = start.flatten().nonzero().flatten().to(torch.int32)
            end = torch.tensor([b * s], dtype=torch.int32, device=d.device)
            self._cache["cu"] = (torch.cat([starts, end]), s)
        return self._cache["cu"]


class DocumentContext:
    """The documents of the model's current micro-batch, read by every attention layer.

    The model sets it at the start of each forward; a recompute in backward (full or selective)
    runs before the next micro-batch's forward, so it reads the same documents. None: one
    causal sequence with positions ``0..s-1``.
    """

    def __init__(self):
        self.current: Documents | None = None


def document_layout(inputs: torch.Tensor, eod: int, reset_position_ids: bool,
                    reset_attention_mask: bool, eod_mask_loss: bool
                    ) -> tuple[Documents | None, torch.Tensor | None]:
    """``(documents, loss_mask)`` of inputs ``[b, s]`` (see the module docstring): documents
    None unless positions or attention reset; ``loss_mask`` ``[b, s]`` float (0 at eod inputs)
    with ``eod_mask_loss``, else None."""
    is_eod = inputs == eod
    loss_mask = (~is_eod).float() if eod_mask_loss else None
    if not (reset_position_ids or reset_attention_mask):
        return None, loss_mask
    before = torch.zeros_like(is_eod, dtype=torch.int64)
    before[:, 1:] = is_eod[:, :-1].cumsum(dim=1)  # eods strictly before each position
    positions = None
    if reset_position_ids:
        idx = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
        after_eod = torch.zeros_like(before)
        after_eod[:, 1:] = torch.where(is_eod[:, :-1], idx[:, 1:], 0)
        positions = idx - after_eod.cummax(dim=1).values  # restart after the last eod
    return Documents(positions, before if reset_attention_mask else None), loss_mask
