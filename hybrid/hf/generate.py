"""Sample text from a trained model with transformers' own ``generate`` (one process).

``python -m hybrid.generate --hf-dir HF_DIR --prompt "..." [--max-new-tokens N]
[--temperature T] [--top-k K] [--top-p P] [--seed S]``, or ``--load CKPT_DIR [--iteration N]``
to sample straight from a training checkpoint (exported to a temporary directory first).

The prompt starts as a document starts in training: with the tokenizer's BOS where its
post-processor adds one (Llama 3's ``<|begin_of_text|>``), else after the end-of-document id
(EOS) that precedes every document but the first; sampling stops at the next end of document.
Works for every class ``hybrid.export_hf`` writes (GPT-2, Llama, Qwen2, Qwen3).
``--temperature 0`` is greedy. The same seed gives the same text.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch


def prompt_ids(tok, prompt: str, eod: int | None) -> list[int]:
    """The ids the model continues: ``tok``'s own encoding of ``prompt`` with its special
    tokens when it adds any (BOS), else ``[eod] + ids``.

    Raises:
        ValueError: no BOS, no EOS and an empty prompt (nothing to condition on).
    """
    ids = tok.encode(prompt, add_special_tokens=True)
    if not tok.encode("", add_special_tokens=True) and eod is not None:
        ids = [eod] + ids
    if not ids:
        raise ValueError("the model has no eos_token_id and the tokenizer adds no BOS, so the "
                         "prompt must not be empty")
    return ids


def generate(hf_dir: str, prompt: str, max_new_tokens: int = 64, temperature: float = 1.0,
             top_k: int = 50, top_p: float = 1.0, seed: int = 1234, device: str = "cpu") -> str:
    """The text the model writes after ``prompt`` (the prompt itself not included).

    Raises:
        ValueError: a bad sampling setting, or prompt plus ``max_new_tokens`` longer than the
            model's positions (``n_positions`` / ``max_position_embeddings``); the message
            gives the numbers.
        FileNotFoundError: ``hf_dir`` is not a directory, holds no ``config.json`` (a training
            checkpoint, named as such: :func:`no_config`) or no tokenizer.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens} must be >= 1")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need --temperature >= 0 (got {temperature}), --top-k >= 0 (got {top_k}, "
                         f"0: off) and 0 < --top-p <= 1 (got {top_p})")
    from pathlib import Path

    if not Path(hf_dir).is_dir():
        raise FileNotFoundError(f"--hf-dir {hf_dir}: no such directory (an export_hf output "
                                "directory)")
    if not (Path(hf_dir) / "config.json").is_file():
        raise FileNotFoundError(no_config(hf_dir))
    if not (Path(hf_dir) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"--hf-dir {hf_dir} has no tokenizer.json: the checkpoint was "
                                "exported without a tokenizer (trained on --mock-data?); export "
                                "again with --tokenizer-model")
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    eod = model.config.eos_token_id
    ids = prompt_ids(tok, prompt, eod)
    limit = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    if len(ids) + max_new_tokens > limit:
        raise ValueError(f"{len(ids)} prompt tokens + --max-new-tokens {max_new_tokens} exceed the "
                         f"model's {limit} positions")
    x = torch.tensor([ids], device=device)
    sampling = dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p) \
        if temperature > 0 \
        else dict(do_sample=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                             eos_token_id=eod, pad_token_id=eod, **sampling)
    return tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def no_config(hf_dir) -> str:
    """Why ``hf_dir`` (a directory without ``config.json``) cannot be sampled: a training
    checkpoint (``iter_*`` directories or Megatron's pointer file) is named as one, with the
    commands that read it."""
    from pathlib import Path

    from hybrid.checkpoint.directory import POINTER
    from hybrid.checkpoint.names import list_iterations

    if (Path(hf_dir) / POINTER).is_file() or list_iterations(hf_dir):
        return (f"--hf-dir {hf_dir} is a training checkpoint (no config.json), not a Hugging "
                f"Face model directory: sample from it with --load {hf_dir}, or export it once "
                f"with python -m hybrid.export_hf --load {hf_dir} --output HF_DIR")
    return (f"--hf-dir {hf_dir} has no config.json: not a Hugging Face model directory (python "
            "-m hybrid.export_hf --load CHECKPOINT --output HF_DIR writes one)")


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` appends "(default: X)" to every flag whose help does not already name one."""

    def _get_help_string(self, action):
        if "default" in (action.help or "") or action.default is None:
            return action.help
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="hybrid-generate",
                                description=__doc__.split("\n")[0],
                                formatter_class=_DefaultsFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-dir", help="Hugging Face model directory (from hybrid.export_hf)")
    src.add_argument("--load",
                     help="training checkpoint directory (exported to a temporary directory)")
    p.add_argument("--iteration", type=int,
                   help="with --load: which iteration (default: the latest)")
    p.add_argument("--tokenizer-model",
                   help="with --load: sentencepiece .model file or Hugging Face tokenizer "
                        "directory (default: the checkpoint's)")
    p.add_argument("--tokenizer-type", choices=["SentencePieceTokenizer", "HuggingFaceTokenizer"],
                   help="with --load: what --tokenizer-model is (default: from the path)")
    p.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="softmax temperature; 0 is greedy")
    p.add_argument("--top-k", type=int, default=50,
                   help="sample among the K most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--seed", type=int, default=1234, help="random seed (same seed, same text)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device to sample on")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hybrid-generate-") as tmp:
        hf_dir = a.hf_dir
        try:
            if a.load:
                from hybrid.hf.export import export_hf

                hf_dir = f"{tmp}/hf"
                export_hf(a.load, hf_dir, a.iteration, a.tokenizer_model,
                          tokenizer_type=a.tokenizer_type)
            text = generate(hf_dir, a.prompt, a.max_new_tokens, a.temperature, a.top_k, a.top_p,
                            a.seed, a.device)
        except (OSError, ValueError) as e:
            print(f"generate: error: {e}", file=sys.stderr)
            return 2
    print(a.prompt + text)
    return 0
