"""The one rule of whether a model splits over ``tp`` tensor-parallel ranks, and why not.

Megatron-style tensor parallelism (Shoeybi et al. 2019, arXiv 1909.08053 §3) gives each of the
``tp`` ranks whole attention heads, whole K/V groups under grouped-query attention (arXiv
2305.13245 §2.2), an equal slice of the MLP width, an equal slice of the (padded) vocabulary
(§5.1) and, under sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198 §4.2.2), an
equal slice of the sequence. :func:`tp_split_refusal` checks them in that order; the job's
checks, the TP plan, the planner and the FLOP arithmetic all call it and word its answer the way
their users have always read it (the methods of :class:`SplitRefusal`).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.config import GPTConfig

_FLAGS = {"num_attention_heads": "--num-attention-heads", "num_query_groups": "--num-query-groups",
          "ffn_hidden_size": "--ffn-hidden-size", "vocab_size": "--vocab-size"}


@dataclass(frozen=True)
class SplitRefusal:
    """The first dimension that ``tp`` does not divide."""

    dimension: str
    """``num_attention_heads``, ``num_query_groups``, ``ffn_hidden_size``, ``vocab_size`` or
    ``seq_length``."""
    value: int
    """Its size (heads, K/V heads, elements, tokens)."""
    tp: int
    """The tensor-parallel size asked for."""

    def valid_tp(self) -> list[int]:
        """The tensor-parallel sizes that divide this dimension."""
        return [t for t in range(1, self.value + 1) if self.value % t == 0]

    def __str__(self) -> str:
        """The FLOP arithmetic's words: ``tp=T does not divide name=value``."""
        hint = (" (pad it with hybrid.parallel.vocab.pad_vocab_size)"
                if self.dimension == "vocab_size" else "")
        return f"tp={self.tp} does not divide {self.dimension}={self.value}{hint}"

    def flag_message(self) -> str:
        """``hybrid.pretrain``'s words, in its flag names."""
        t, v = self.tp, self.value
        if self.dimension == "seq_length":
            return (f"--sequence-parallel needs --seq-length divisible by "
                    f"--tensor-model-parallel-size: {v} % {t} = {v % t}")
        message = (f"{_FLAGS[self.dimension]} {v} is not divisible by "
                   f"--tensor-model-parallel-size {t}")
        if self.dimension == "num_query_groups":
            message += (f": each TP rank holds whole K/V heads; valid tp values: "
                        f"{', '.join(map(str, self.valid_tp()))}")
        return message

    def layer_message(self) -> str:
        """The TP plan's words (``hybrid.parallel.tp_plan``), in GPTConfig's field names."""
        groups = self.dimension == "num_query_groups"
        why = " (each TP rank holds whole K/V heads)" if groups else ""
        return (f"tensor-model-parallel size {self.tp} does not divide {self.dimension}="
                f"{self.value}{why}")


def tp_split_refusal(model: GPTConfig, tp: int, *, vocab_size: int | None = None,
                     sequence_length: int | None = None) -> SplitRefusal | None:
    """None when ``model`` splits over ``tp`` ranks, else the first dimension that does not.

    Args:
        model: the model; its heads, K/V groups (``query_groups``) and MLP width are checked.
        tp: tensor-parallel size (positive).
        vocab_size: the vocabulary as the embedding sees it (padded), checked when given.
        sequence_length: tokens per sample, checked when given (sequence parallelism on).
    """
    for dimension, value in (("num_attention_heads", model.num_attention_heads),
                             ("num_query_groups", model.query_groups),
                             ("ffn_hidden_size", model.ffn_hidden_size),
                             ("vocab_size", vocab_size), ("seq_length", sequence_length)):
        if value is not None and value % tp:
            return SplitRefusal(dimension, value, tp)
    return None
