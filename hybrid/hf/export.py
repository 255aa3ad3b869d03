"""Export a training checkpoint as a Hugging Face model directory.

``python -m hybrid.export_hf --load CKPT_DIR --output HF_DIR [--iteration N]
[--tokenizer-model TOK] [--max-shard-size 5GB]``

Picks the transformers class that computes the checkpoint's model exactly: ``GPT2LMHeadModel``
(learned positions, LayerNorm, exact GELU), ``LlamaForCausalLM`` (RoPE, RMSNorm, SwiGLU, GQA,
biases on every linear layer or none), ``Qwen2ForCausalLM`` (Q/K/V biases only) or
``Qwen3ForCausalLM`` (QK-norm); anything else is refused, naming the setting. Writes
``config.json``, ``generation_config.json`` (the EOS id), the fp32 master weights as sharded
safetensors with ``model.safetensors.index.json`` (``--max-shard-size``; one
``model.safetensors`` when it fits), streamed one tensor at a time from a checkpoint saved on
any grid, in the format its ``metadata.json`` names, and the tokenizer: a sentencepiece model
translated to ``tokenizer.json``, or a Hugging Face tokenizer's files copied. A tokenizer
whose vocabulary is not the model's is refused. The directory appears complete or not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from hybrid.checkpoint.format import Reader
from hybrid.checkpoint.published import IncompleteCheckpointError
from hybrid.checkpoint.registry import open_checkpoint
from hybrid.checkpoint.stream import Entry
from hybrid.hf import convert as gpt2
from hybrid.hf import llama_weights as llama
from hybrid.hf.convert import UnsupportedModelError
from hybrid.hf.export_tokenizer import export_tokenizer, tokenizer_source
from hybrid.hf.llama_config import export_family, llama_config_dict
from hybrid.hf.sharded import DEFAULT_MAX_SHARD_SIZE, parse_size, write_sharded
from hybrid.hf.weights import is_norm_weight
from models.config import GPTConfig


def _check_output(output: Path) -> None:
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise FileExistsError(f"--output {output} exists and is not an empty directory; "
                              "give a new directory (nothing is overwritten)")


def model_family(model: dict) -> tuple[GPTConfig, str]:
    """``(config, model_type)`` of a checkpoint's ``metadata.json`` ``model`` entry:
    ``gpt2``, ``llama``, ``qwen2`` or ``qwen3``.

    Raises:
        UnsupportedModelError: a field this code does not know, or a model no class holds
            exactly (the setting named).
    """
    import dataclasses

    known = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(model) - known)
    if unknown:
        raise UnsupportedModelError(f"the checkpoint's model has settings export does not know: "
                                    f"{unknown}")
    config = GPTConfig(**model)
    if config.position_embedding_type == "learned_absolute":
        gpt2.check_gpt2_architecture(config)
        return config, "gpt2"
    try:
        return config, export_family(config)
    except ValueError as e:
        raise UnsupportedModelError(f"no transformers class holds this model exactly: {e}") \
            from None


class _Tensors:
    """Our full tensors read from the checkpoint, the last one kept (q, k and v are three HF
    tensors of one of ours): one of our tensors held at a time."""

    def __init__(self, reader: Reader):
        self.reader, self.name, self.tensor = reader, None, None

    def __call__(self, name: str) -> torch.Tensor:
        if name != self.name:
            self.name, self.tensor = None, None  # free the previous one first
            self.tensor, self.name = self.reader.full_tensor(name, "master").contiguous(), name
        return self.tensor


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``--dtype`` values: the weights' type in the export (fp32 masters rounded to nearest)."""


def entries(reader: Reader, config: GPTConfig, family: str,
            dtype: torch.dtype = torch.float32) -> list[Entry]:
    """The HF tensors of the checkpoint in ``dtype``, in our parameter order, each produced on
    demand.

    Raises:
        UnsupportedModelError: the checkpoint's parameters are not the class's.
    """
    saved = list(reader.meta["params"])
    expected = gpt2.parameter_names(config) if family == "gpt2" else llama.parameter_names(config)
    if sorted(saved) != sorted(expected):
        raise UnsupportedModelError(f"checkpoint parameters differ from {family}'s: extra "
                                    f"{sorted(set(saved) - set(expected))}, missing "
                                    f"{sorted(set(expected) - set(saved))}")
    full, out = _Tensors(reader), []
    for name in expected:
        shape = torch.empty(reader.meta["params"][name]["full_shape"], device="meta")
        if family == "gpt2":
            keys, metas = [gpt2.hf_name(name)], [gpt2.to_hf(name, shape, config)]
            make = [lambda n=name: gpt2.to_hf(n, full(n), config).contiguous()]
        else:
            keys, metas = llama.hf_keys(name), llama.to_hf(name, shape, config)
            make = [lambda n=name, i=i: llama.to_hf(n, full(n), config)[i]
                    for i in range(len(keys))]
        if config.apply_layernorm_1p and is_norm_weight(name):  # HF norms scale by w itself
            make = [lambda f=f: f() + 1 for f in make]
        out += [Entry(k, dtype, tuple(m.shape), lambda f=f: f().to(dtype))
                for k, m, f in zip(keys, metas, make, strict=True)]
    return out


def _config_json(config: GPTConfig, family: str, token_ids: dict) -> dict:
    from transformers import AutoConfig

    hf = (gpt2.hf_config_dict(config, token_ids) if family == "gpt2"
          else llama_config_dict(config, token_ids))
    kind = "gpt2" if family == "gpt2" else hf.pop("model_type")
    out = AutoConfig.for_model(kind, **hf).to_dict()
    for key in ("rope_theta", "rope_scaling"):  # the older spelling too, for older readers
        if key in hf:
            out[key] = hf[key]
    return out


def export_hf(load: str | os.PathLike, output: str | os.PathLike, iteration: int | None = None,
              tokenizer_model: str | os.PathLike | None = None,
              max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
              tokenizer_type: str | None = None, dtype: str = "float32") -> dict:
    """Write the HF directory ``output`` from checkpoint ``load`` (latest, or ``iteration``).

    Args:
        tokenizer_model: tokenizer to export (a ``.model`` file or a Hugging Face tokenizer
            directory; default: the one the checkpoint's ``metadata.json`` names); without one
            only the model is written.
        max_shard_size: largest safetensors file (``"5GB"``: 5 10^9 bytes, as transformers).
        tokenizer_type: ``SentencePieceTokenizer`` / ``HuggingFaceTokenizer`` (default: the
            checkpoint's ``--tokenizer-type``, else inferred from the path).
        dtype: ``float32`` (the masters as they are), ``bfloat16`` or ``float16`` (rounded to
            nearest; a bf16 Hugging Face model imported and exported untrained comes back
            bitwise).

    Returns:
        The checkpoint's ``metadata.json`` with ``"hf_config"`` (``config.json``),
        ``"tokenizer_exported"`` (the tokenizer path, or None) and ``"files"`` added.

    Raises:
        FileNotFoundError / IncompleteCheckpointError: ``load`` does not exist or holds no
            complete checkpoint, or the tokenizer is missing.
        FileExistsError: ``output`` exists and is not empty.
        ValueError: a bad ``max_shard_size`` or ``dtype``; a tokenizer of another vocabulary.
        UnsupportedModelError: no transformers class holds the model exactly (the setting
            named).
    """
    output, max_bytes = Path(output), parse_size(max_shard_size)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: valid: {', '.join(DTYPES)}")
    if not Path(load).is_dir():
        raise FileNotFoundError(f"--load {load}: no such directory (the --save directory of a "
                                "training run)")
    _check_output(output)
    reader = open_checkpoint(load, iteration)
    config, family = model_family(reader.meta.get("model", {}))
    tensors = entries(reader, config, family, DTYPES[dtype])
    tok = tokenizer_source(tokenizer_model, tokenizer_type, reader.meta, config.vocab_size)
    tmp = output.with_name(output.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        token_ids = export_tokenizer(tok, tmp) if tok is not None else {}
        hf = _config_json(config, family, token_ids) | {"dtype": dtype}
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        gen = {k: v for k, v in token_ids.items() if v is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        files = write_sharded(tmp, tensors, max_bytes,
                              metadata={"format": "pt", "iteration": str(reader.iteration)})
        if output.exists():
            output.rmdir()  # empty, checked above
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dict(reader.meta, hf_config=hf, files=files,
                tokenizer_exported=tok.model_path if tok is not None else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="hybrid-export-hf",
                                description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="checkpoint directory (the --save of the run)")
    p.add_argument("--output", required=True, help="new Hugging Face model directory to write")
    p.add_argument("--iteration", type=int,
                   help="which iteration (default: the latest complete one)")
    p.add_argument("--tokenizer-model",
                   help="sentencepiece .model file or Hugging Face tokenizer directory (default: "
                        "the one the checkpoint names)")
    p.add_argument("--tokenizer-type", choices=["SentencePieceTokenizer", "HuggingFaceTokenizer"],
                   help="what --tokenizer-model is (default: a directory is HuggingFaceTokenizer)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32",
                   help="weights' type in the export (default: float32, the fp32 masters)")
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                   help="largest safetensors file: 5GB (10^9), 2GiB (2^30) or bytes (default: "
                        "%(default)s, as transformers)")
    args = p.parse_args(argv)
    try:
        meta = export_hf(args.load, args.output, args.iteration, args.tokenizer_model,
                         args.max_shard_size, args.tokenizer_type, args.dtype)
    # UnsupportedModelError is a ValueError
    except (OSError, IncompleteCheckpointError, ValueError) as e:
        print(f"export_hf: error: {e}", file=sys.stderr)
        return 2
    g = meta["grid"]
    hf = meta["hf_config"]
    shape = {k: hf[k] for k in ("n_layer", "num_hidden_layers", "n_embd", "hidden_size",
                                "vocab_size") if k in hf}
    print(f"wrote {args.output}: {hf['architectures'][0]} {json.dumps(shape)} in "
          f"{len(meta['files'])} file(s) "
          f"from iteration {meta['iteration']} (saved at tp={g['tp']} x dp={g['dp']}, ZeRO stage "
          f"{meta['zero_stage']}); tokenizer: "
          f"{meta['tokenizer_exported'] or 'none (no --tokenizer-model)'}")
    return 0
