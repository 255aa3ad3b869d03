"""Worlds and references of document-masked packing (``--reset-position-ids``,
``--reset-attention-mask``, ``--eod-mask-loss``; :mod:`models.documents`).

The packed batch holds documents of many lengths ended by the eod id (one sequence without an
eod, one starting with one, two eods in a row). The reference of the per-token losses is each
document run alone through transformers' ``LlamaForCausalLM`` (positions from 0, nothing of the
other documents in view); the reference of a training trajectory is the single-process GPT with
the same documents under torch AdamW.
"""

from __future__ import annotations

import torch

from hybrid.activation.config import ActivationConfig
from hybrid.parallel.grid import ProcessGrid
from hybrid.train_step import train_step
from hybrid.zero.config import OptimizerConfig, ZeroConfig
from models.documents import document_layout
from tests.tiny import build_parallel

EOD, VOCAB, SEQ, GBS = 255, 256, 32, 4
CFG = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
           ffn_hidden_size=96, vocab_size=VOCAB, max_position_embeddings=64,
           hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope",
           normalization="RMSNorm", swiglu=True, add_bias_linear=False,
           untie_embeddings_and_output_weights=True)
OPT = dict(lr=3e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-6,
           clip_grad=1.0)
STEPS = 3


def packed_batch(step: int = 0) -> torch.Tensor:
    """``[GBS, SEQ + 1]`` tokens: documents of lengths 1 to 20 ended by ``EOD``."""
    g = torch.Generator().manual_seed(77 + step)
    rows = []
    for r in range(GBS):
        t = torch.randint(0, EOD, (SEQ + 1,), generator=g)
        if r == 0:  # no eod at all
            rows.append(t)
            continue
        cuts = torch.randint(1, 20, (8,), generator=g).cumsum(0)
        t[cuts[cuts < SEQ + 1]] = EOD
        if r == 1:
            t[0] = EOD  # a document of one token first, then two eods in a row
            t[5:7] = EOD
        rows.append(t)
    return torch.stack(rows)


def layout(tokens: torch.Tensor, eod_mask_loss: bool):
    return document_layout(tokens[:, :-1], EOD, True, True, eod_mask_loss)


def _engine(grid: ProcessGrid, stage: int, sp: bool, recompute: str | None):
    act = (ActivationConfig(recompute_granularity="selective") if recompute == "selective"
           else ActivationConfig(recompute_granularity="full", recompute_method="uniform",
                                 recompute_num_layers=1) if recompute == "full"
           else None)
    return build_parallel(grid, CFG, zero=ZeroConfig(stage=stage, param_persistence_threshold=0),
                          optimizer=OptimizerConfig(**OPT), activation=act,
                          sequence_parallel=sp)


def _rows(grid: ProcessGrid) -> slice:
    per = GBS // grid.dp_size
    return slice(grid.dp_rank * per, (grid.dp_rank + 1) * per)


def run(grid: ProcessGrid, stage: int, sp: bool, recompute: str | None) -> dict:
    """Per-token losses of the packed batch (this rank's rows), then ``STEPS`` training steps
    with ``--eod-mask-loss``: the logged losses and the final weights (rank 0)."""
    engine = _engine(grid, stage, sp, recompute)
    tokens = packed_batch()[_rows(grid)]
    docs, _ = layout(tokens, False)
    with torch.no_grad():
        engine.eval()
        per_token = engine.model(tokens[:, :-1], tokens[:, 1:], documents=docs)
        engine.train()
    losses = []
    for step in range(STEPS):
        t = packed_batch(step)[_rows(grid)]
        d, mask = layout(t, True)
        r = train_step(engine, [{"tokens": t, "loss_mask": mask, "documents": d}], OPT["lr"],
                       grid, per_token=True)
        losses.append(r.loss)
    final = engine.model_state_dict_full()
    engine.close()
    return dict(rows=_rows(grid), per_token=per_token, losses=losses,
                final=final if grid.rank == 0 else None)


def world1(rank: int, world: int) -> dict:
    return {"tp1_dp1_zero0": run(ProcessGrid(tp=1), 0, False, None)}


def run_dropout(grid: ProcessGrid, stage: int) -> list[float]:
    """``STEPS`` logged losses with attention and hidden dropout 0.1 (tp2 + SP + selective,
    documents and the loss mask): the same on every ZeRO stage of one grid."""
    from hybrid.parallel.rng import RNGTracker, seed_everything

    seed_everything(5, grid.device)
    tracker = RNGTracker(5, grid.tp_rank, grid.device)
    engine = build_parallel(grid, dict(CFG, attention_dropout=0.1, hidden_dropout=0.1),
                            zero=ZeroConfig(stage=stage, param_persistence_threshold=0),
                            optimizer=OptimizerConfig(**OPT),
                            activation=ActivationConfig(recompute_granularity="selective"),
                            tracker=tracker, sequence_parallel=True)
    losses = []
    for step in range(STEPS):
        t = packed_batch(step)[_rows(grid)]
        d, mask = layout(t, True)
        losses.append(train_step(engine, [{"tokens": t, "loss_mask": mask, "documents": d}],
                                 OPT["lr"], grid, per_token=True).loss)
    engine.close()
    return losses


def world4(rank: int, world: int) -> dict:
    grid = ProcessGrid(tp=2)
    return {"tp2_dp2_zero3_sp_selective": run(grid, 3, True, "selective"),
            "tp2_dp2_zero1_sp_full": run(grid, 1, True, "full"),
            "dropout": {stage: run_dropout(grid, stage) for stage in (0, 3)}}


def reference_training() -> dict:
    """The single-process GPT on the whole packed batch: logged losses (masked sum over the
    unmasked count) and final weights, torch AdamW with the engine's two groups."""
    from models.gpt import GPT, GPTConfig
    from tests.tiny import SEED

    torch.manual_seed(SEED)
    model = GPT(GPTConfig(**CFG))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": OPT["weight_decay"]},
                             {"params": rest, "weight_decay": 0.0}], lr=OPT["lr"],
                            betas=(OPT["adam_beta1"], OPT["adam_beta2"]), eps=OPT["adam_eps"])
    losses = []
    for step in range(STEPS):
        t = packed_batch(step)
        d, mask = layout(t, True)
        loss = (model(t[:, :-1], t[:, 1:], documents=d) * mask).sum() / mask.sum()
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPT["clip_grad"])
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, final={k: v.clone() for k, v in model.state_dict().items()})
