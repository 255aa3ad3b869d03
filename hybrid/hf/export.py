"""Export a training checkpoint as a Hugging Face GPT-2 model directory.

``python -m hybrid.export_hf --load CKPT_DIR --output HF_DIR [--iteration N]``

Writes ``config.json`` (``GPT2LMHeadModel``, exact GELU), ``model.safetensors`` (fp32 master
weights, streamed one tensor at a time from the sharded checkpoint, whatever grid saved it)
and the tokenizer (``tokenizer.json``, ``tokenizer_config.json``) so that
``AutoModelForCausalLM.from_pretrained(HF_DIR)`` and ``AutoTokenizer.from_pretrained(HF_DIR)``
reproduce our model and our sentencepiece tokenizer; the end-of-document id is
``eos_token_id``. The directory appears complete or not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from hybrid.checkpoint.directory import IncompleteCheckpointError
from hybrid.checkpoint.shards import CheckpointReader
from hybrid.checkpoint.stream import Entry, write_safetensors
from hybrid.hf.convert import (
    UnsupportedModelError,
    gpt_config_from_metadata,
    hf_config_dict,
    hf_name,
    parameter_names,
    to_hf,
)


def _check_output(output: Path) -> None:
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise FileExistsError(f"--output {output} exists and is not an empty directory; "
                              "give a new directory (nothing is overwritten)")


def _check_parameters(saved: list[str], expected: list[str]) -> None:
    """Raises UnsupportedModelError when the saved names are not GPT-2's."""
    if sorted(saved) != sorted(expected):
        extra = sorted(set(saved) - set(expected))
        raise UnsupportedModelError(f"checkpoint parameters GPT-2 has no place for: {extra}"
                                    if extra else
                                    "checkpoint lacks GPT-2 parameters: "
                                    f"{sorted(set(expected) - set(saved))}")


def _tokenizer_path(given: str | os.PathLike | None, named: str | None) -> str | None:
    """The tokenizer to export: ``--tokenizer-model``, else the checkpoint's; FileNotFoundError
    when that file is missing."""
    path = given or named
    if path and not Path(path).is_file():
        raise FileNotFoundError(f"--tokenizer-model {path}: file not found" if given else
                                f"tokenizer {path} (named by the checkpoint) not found: give "
                                "--tokenizer-model")
    return path


def export_hf(load: str | os.PathLike, output: str | os.PathLike, iteration: int | None = None,
              tokenizer_model: str | os.PathLike | None = None) -> dict:
    """Write the HF directory ``output`` from checkpoint ``load`` (latest, or ``iteration``).

    Args:
        tokenizer_model: sentencepiece model to export (default: the one the checkpoint's
            ``metadata.json`` names); without one only the model is written.

    Returns:
        The checkpoint's ``metadata.json``, with ``"hf_config"`` (what ``config.json`` holds)
        and ``"tokenizer_exported"`` (the tokenizer path, or None) added.

    Raises:
        FileNotFoundError / IncompleteCheckpointError: no complete checkpoint, or the tokenizer
            file is missing.
        FileExistsError: ``output`` exists and is not empty.
        UnsupportedModelError: the checkpoint's model has a setting or a parameter GPT-2
            cannot express (named).
    """
    from transformers import GPT2Config

    output = Path(output)
    _check_output(output)
    reader = CheckpointReader(load, iteration)
    config = gpt_config_from_metadata(reader.meta.get("model", {}))
    saved = reader.param_names()
    _check_parameters(saved, parameter_names(config))
    tok_path = _tokenizer_path(tokenizer_model, reader.meta.get("tokenizer"))
    tmp = output.with_name(output.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        token_ids = {}
        if tok_path:
            from hybrid.hf.tokenizer import save_tokenizer

            token_ids = save_tokenizer(tok_path, tmp)
        hf = hf_config_dict(config, token_ids)
        GPT2Config(**hf).save_pretrained(str(tmp))
        entries = []  # one full tensor at a time (its read, then GPT-2's layout of it)
        for name in saved:
            shape = reader.meta["params"][name]["full_shape"]
            hf_shape = tuple(to_hf(name, torch.empty(shape, device="meta"), config).shape)
            entries.append(Entry(hf_name(name), torch.float32, hf_shape, lambda n=name: to_hf(
                n, reader.full_tensor(n, "master").contiguous(), config).contiguous()))
        write_safetensors(tmp / "model.safetensors", entries,
                          metadata={"format": "pt", "iteration": str(reader.iteration)})
        if output.exists():
            output.rmdir()  # empty, checked above
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dict(reader.meta, hf_config=hf, tokenizer_exported=tok_path or None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="hybrid-export-hf",
                                description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="checkpoint directory (the --save of the run)")
    p.add_argument("--output", required=True, help="new Hugging Face model directory to write")
    p.add_argument("--iteration", type=int,
                   help="which iteration (default: the latest complete one)")
    p.add_argument("--tokenizer-model",
                   help="sentencepiece model (default: the one the checkpoint names)")
    args = p.parse_args(argv)
    try:
        meta = export_hf(args.load, args.output, args.iteration, args.tokenizer_model)
    # UnsupportedModelError is a ValueError
    except (OSError, IncompleteCheckpointError, ValueError) as e:
        print(f"export_hf: error: {e}", file=sys.stderr)
        return 2
    g = meta["grid"]
    shape = {k: meta["hf_config"][k] for k in ("n_layer", "n_embd", "n_head", "vocab_size")}
    print(f"wrote {args.output}: GPT2LMHeadModel {json.dumps(shape)} "
          f"from iteration {meta['iteration']} (saved at tp={g['tp']} x dp={g['dp']}, ZeRO stage "
          f"{meta['zero_stage']}); tokenizer: "
          f"{meta['tokenizer_exported'] or 'none (no --tokenizer-model)'}")
    return 0
