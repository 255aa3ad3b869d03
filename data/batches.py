"""Token micro-batches between the loader (:mod:`data.loader`) and the model: each checked
against the vocabulary (:func:`checked_tokens`) and, with Megatron-LM's document flags, given its
packed documents' layout (:func:`packed_documents`). Host-side, before any device copy."""

from __future__ import annotations


def packed_documents(batches, eod: int, reset_position_ids: bool, reset_attention_mask: bool,
                     eod_mask_loss: bool):
    """``batches`` ``[b, s+1]`` as ``{"tokens", "loss_mask", "documents"}`` micro-batches
    (:func:`models.documents.document_layout` of the inputs, on the host as Megatron-LM's
    dataset builds them): ``--reset-position-ids``, ``--reset-attention-mask``,
    ``--eod-mask-loss``."""
    from models.documents import document_layout

    for tokens in batches:
        docs, mask = document_layout(tokens[:, :-1], eod, reset_position_ids,
                                     reset_attention_mask, eod_mask_loss)
        yield {"tokens": tokens, "loss_mask": mask, "documents": docs}


def checked_tokens(batches, vocab_size: int, source):
    """Yield ``batches`` (int64 ``[b, s + 1]`` on the host), refusing a token id outside
    ``[0, vocab_size)``: data preprocessed with another tokenizer would otherwise be trained on
    silently (the vocabulary-parallel embedding and loss treat an id they do not hold as
    another rank's). One ``max``/``min`` per micro-batch on the host, before any device copy.

    Raises:
        ValueError: naming the id, the vocabulary size and the data.
    """
    for batch in batches:
        hi, lo = int(batch.max()), int(batch.min())
        if hi >= vocab_size or lo < 0:
            bad = hi if hi >= vocab_size else lo
            raise ValueError(f"token id {bad} in --data-path {' '.join(map(str, source or []))} "
                             f"is outside the vocabulary [0, {vocab_size}) of this run's "
                             "tokenizer/--vocab-size: the data was preprocessed with another "
                             "tokenizer (preprocess it again with --tokenizer-model, or give the "
                             "tokenizer it was made with)")
        yield batch
