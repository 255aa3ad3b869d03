"""Megatron-LM flags that have no field here, answered so that its example scripts port.

Each such flag gets one of three answers (:func:`translate`):

* **its meaning**, as this trainer's own flags (``--use-distributed-optimizer`` is ZeRO-1 when no
  ``--zero-stage`` is given, ``--recompute-activations`` is selective recompute, ...);
* **accepted without effect** (kernel, fusion and backend choices, which change no result here),
  listed in one start-up note;
* **refused as out of scope**, one line per flag naming the feature (pipeline parallelism > 1,
  context parallelism, MoE, FP8, ...), before any process group starts.

A value of a flag is every following token that does not start with ``--`` (the pretraining
command line has no positional arguments).
"""

from __future__ import annotations

from hybrid.config_fields import ConfigError

MEANING = {
    "--use-distributed-optimizer": ["--zero-stage", "1"],
    "--recompute-activations": ["--recompute-granularity", "selective"],
    "--distribute-saved-activations": ["--partition-activations"],
    "--exit-signal-handler": [],  # SIGTERM always finishes the iteration, saves and exits
    "--accumulate-allreduce-grads-in-fp32": [],  # gradients are always accumulated in fp32
    "--no-position-embedding": ["--position-embedding-type", "none"],  # [] beside RoPE
    "--log-throughput": [],  # every log line has tokens/s and TFLOP/s per device
    # --optimizer-cpu-offload needs it in Megatron-LM (its hybrid optimizer's code path); here
    # the fp32 master is the optimizer's own parameter whether offloaded or not
    "--use-precision-aware-optimizer": [],
    # offloaded: gradient copies overlap backward, parameter copies the next forward's gathers
    "--overlap-cpu-optimizer-d2h-h2d": [],
}
"""Flag -> the equivalent flags here (empty: what happens here anyway)."""

MEANING_HELP = {
    "--use-distributed-optimizer": "--zero-stage 1 unless --zero-stage is given (Megatron-LM "
    "without it is plain data parallelism: --zero-stage 0 here)",
    "--recompute-activations": "--recompute-granularity selective",
    "--distribute-saved-activations": "--partition-activations",
    "--exit-signal-handler": "what happens anyway: SIGTERM finishes the iteration, saves and "
    "exits 0",
    "--accumulate-allreduce-grads-in-fp32": "what happens anyway: gradients are accumulated in "
    "fp32",
    "--no-position-embedding": "--position-embedding-type none (no learned position table; "
    "with --position-embedding-type rope it changes nothing, RoPE having no table)",
    "--log-throughput": "what happens anyway: every log line has tokens/s and TFLOP/s per device",
    "--use-precision-aware-optimizer": "what happens anyway: the fp32 master is the optimizer's "
    "own parameter, offloaded or not",
    "--overlap-cpu-optimizer-d2h-h2d": "what happens anyway: offloaded gradient copies overlap "
    "backward, parameter copies the next forward's gathers",
}
"""What each :data:`MEANING` flag does here, for ``--help``."""

SIZE_ONE = {"--pipeline-model-parallel-size": "pipeline parallelism",
            "--context-parallel-size": "context parallelism",
            "--expert-model-parallel-size": "expert parallelism (MoE)",
            "--expert-tensor-parallel-size": "expert parallelism (MoE)"}
"""Parallel sizes accepted at 1 (what this trainer does) and refused above."""

NO_OP = {
    "--use-mcore-models", "--use-legacy-models", "--distributed-backend", "--attention-backend",
    "--use-flash-attn", "--transformer-impl", "--no-masked-softmax-fusion",
    "--masked-softmax-fusion",
    # no persistent LayerNorm kernel here: the fused norm is compiled (or apex's FusedLayerNorm)
    "--no-persist-layer-norm", "--cross-entropy-loss-fusion",
    "--cross-entropy-fusion-impl", "--no-async-tensor-model-parallel-allreduce",
    "--manual-gc", "--manual-gc-interval",
    "--timing-log-level", "--timing-log-option", "--num-workers", "--no-mmap-bin-files",
    "--mmap-bin-files", "--no-create-attention-mask-in-dataloader", "--dataloader-type",
    "--empty-unused-memory-level", "--use-cpu-initialization",
    "--log-params-norm", "--log-num-zeros-in-grad",
    "--tiktoken-pattern",  # read by TikTokenizer only, which is refused
    "--tensorboard-log-interval", "--tensorboard-queue-size", "--log-timers-to-tensorboard",
    "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard",
    # Q.K^T / (layer number) before an fp32 softmax: the same probabilities, kept for fp16 range
    "--apply-query-key-layer-scaling", "--no-query-key-layer-scaling",
}
"""Kernel, fusion, backend and logging choices with no effect on the result here."""

REFUSED = {
    "--virtual-pipeline-model-parallel-size": "pipeline parallelism",
    "--num-layers-per-virtual-pipeline-stage": "pipeline parallelism",
    "--decoder-first-pipeline-num-layers": "pipeline parallelism",
    "--decoder-last-pipeline-num-layers": "pipeline parallelism",
    "--num-experts": "mixture of experts (MoE)",
    "--fp8-format": "FP8 training", "--fp8-param-gather": "FP8 training",
    "--fp8-recipe": "FP8 training", "--fp8-amax-history-len": "FP8 training",
    "--fp8-amax-compute-algo": "FP8 training", "--fp4-format": "FP4 training",
    "--mtp-num-layers": "multi-token prediction",
    "--multi-latent-attention": "multi-latent attention",
    "--use-torch-fsdp2": "FSDP (--zero-stage 3 partitions the parameters here)",
    "--use-megatron-fsdp": "FSDP (--zero-stage 3 partitions the parameters here)",
    "--step-batch-size-schedule": "a batch-size schedule",
    "--rotary-seq-len-interpolation-factor": "RoPE sequence-length interpolation",
}
"""Flag -> the feature it asks for, which this trainer does not have."""

REFUSED_PREFIXES = {"--moe-": "mixture of experts (MoE)", "--fp8-": "FP8 training"}

ONLY_VALUE = {"--dataloader-type": ("single", "Megatron-LM's default sampler, the samples in "
                                              "order, is the one implemented here")}
"""Flags of :data:`NO_OP` that are without effect at one value only (Megatron-LM's default):
flag -> (that value, why the others are refused)."""

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = (*SENTENCEPIECE_TYPES, "HuggingFaceTokenizer", "GPT2BPETokenizer",
                   "NullTokenizer")
"""``--tokenizer-type`` values this trainer reads: sentencepiece and Hugging Face
(``--tokenizer-model``), GPT-2 BPE (``--vocab-file``, ``--merge-file``) and none
(``--vocab-size`` alone, token ids as they are)."""


def _split(argv: list[str]) -> list[tuple[str, list[str]]]:
    """``[(flag, its values)]``; a token before any flag is kept as a flag of its own."""
    items: list[tuple[str, list[str]]] = []
    for tok in argv:
        if tok.startswith("--") or not items:
            flag, eq, value = tok.partition("=")
            items.append((flag, [value] if eq else []))
        else:
            items[-1][1].append(tok)
    return items


def _refusal(flag: str, values: list[str]) -> str | None:
    if flag in ONLY_VALUE and values and values != [ONLY_VALUE[flag][0]]:
        return f"{flag} {' '.join(values)}: only {ONLY_VALUE[flag][0]} ({ONLY_VALUE[flag][1]})"
    if flag in SIZE_ONE and values != ["1"]:
        return f"{flag} {' '.join(values)}: {SIZE_ONE[flag]} is not supported here (only 1)"
    if flag in REFUSED:
        return f"{flag}: {REFUSED[flag]} is not supported here"
    prefix = next((p for p in REFUSED_PREFIXES if flag.startswith(p)), None)
    if prefix is not None:
        return f"{flag}: {REFUSED_PREFIXES[prefix]} is not supported here"
    if flag == "--tokenizer-type" and values and values[0] not in TOKENIZER_TYPES:
        sp = ", ".join(SENTENCEPIECE_TYPES)
        return (f"--tokenizer-type {values[0]}: only sentencepiece ({sp}) and "
                "HuggingFaceTokenizer with --tokenizer-model, GPT2BPETokenizer (--vocab-file, "
                "--merge-file) and NullTokenizer (--vocab-size) "
                "are supported here")
    return None


def translate(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(argv with Megatron-LM's flags answered, the flags accepted without effect)``.

    Raises:
        ConfigError: one line per refused flag, naming the feature it asks for.
    """
    items = _split(list(argv))
    given = {flag for flag, _ in items}
    out: list[str] = []
    ignored: list[str] = []
    refused = [r for flag, values in items if (r := _refusal(flag, values)) is not None]
    if refused:
        raise ConfigError("Megatron-LM flags for features this trainer does not have:\n  "
                          + "\n  ".join(refused))
    granularity = [v for f, v in items if f == "--recompute-granularity"]
    if "--recompute-activations" in given and granularity and granularity[-1] != ["selective"]:
        raise ConfigError(f"--recompute-activations is selective recompute (Megatron-LM sets "
                          f"--recompute-granularity selective for it), but --recompute-granularity "
                          f"{' '.join(granularity[-1])} is given too: give one of them")
    for flag, values in items:
        if flag in MEANING:
            equivalent = MEANING[flag]
            if flag == "--use-distributed-optimizer" and "--zero-stage" in given:
                equivalent = []  # an explicit ZeRO stage already partitions (or not)
            if flag == "--no-position-embedding" and given & {
                    "--use-rotary-position-embeddings", "--position-embedding-type"}:
                equivalent = []  # Megatron's older spelling beside RoPE: no learned table
            if equivalent and equivalent[0] not in out:
                out += equivalent
        elif flag in SIZE_ONE or flag in NO_OP:
            if flag in NO_OP:
                ignored.append(" ".join([flag, *values]))
        else:
            out += [flag, *values]
    return out, ignored


def default_stage_note(given: set[str], dp: int) -> str | None:
    """The start-up note for a run that set no ZeRO stage (``zero_stage`` not in ``given``, the
    fields a flag or ``--config`` set) over ``dp`` > 1 data-parallel ranks: the default is
    ZeRO-1, where a Megatron-LM command without ``--use-distributed-optimizer`` (which means
    ``--zero-stage 1`` here) trains plain data parallelism. None otherwise."""
    if "zero_stage" in given or dp == 1:
        return None
    return ("hybrid-pretrain: note: ZeRO-1, the default --zero-stage: the fp32 master and Adam "
            f"moments are partitioned over the {dp} data-parallel ranks (the same losses as "
            "plain data parallelism, less memory); Megatron-LM without "
            "--use-distributed-optimizer trains plain data parallelism, --zero-stage 0 here")


def add_help_group(parser) -> None:
    """List every Megatron-LM flag answered here (:data:`MEANING`, :data:`SIZE_ONE`,
    :data:`NO_OP`, :data:`REFUSED`) in a ``--help`` group of its own, each with what it does
    here. :func:`translate` takes them out of the command line before argparse parses it, so
    these entries only document."""
    g = parser.add_argument_group(
        "Megatron-LM compatibility", "Megatron-LM's flags without a field here, accepted so that "
        "its example scripts run: each means one of this trainer's flags, is accepted without "
        "effect (named in one start-up note), or is refused before any process group starts "
        "(also every --moe-* and --fp8-* flag)")
    helps = {**{f: MEANING_HELP[f] for f in MEANING},  # a new MEANING flag needs its help
             **{f: f"accepted at 1; above 1 refused: {what} is not supported here"
                for f, what in SIZE_ONE.items()},
             **{f: "accepted without effect (a kernel, fusion, backend or logging choice)"
                for f in sorted(NO_OP)},
             **{f: f"refused: {what} is not supported here" for f, what in REFUSED.items()}}
    for flag, text in helps.items():
        g.add_argument(flag, dest=f"megatron_{flag[2:]}", action="store_const", const=True,
                       help=text)
