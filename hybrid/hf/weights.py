"""A local Hugging Face directory (GPT-2, Llama, Qwen2, Qwen3) as a source of our full tensors
(``--init-from-hf``).

Reads ``config.json`` and ``model.safetensors`` (or the shards a ``model.safetensors.index.json``
lists) with safetensors only: no ``transformers``, and nothing unpickled (``pytorch_model.bin``
is refused). Tensors are read one at a time when asked for (an HF tensor memory-mapped, ours
built from it), so the loader holds one of our tensors at a time.

Nothing in the files is dropped silently: a tensor our model has no place for is refused by
name; a tied model's ``lm_head.weight`` is accepted only when it equals the embedding (compared
in row blocks), and older Llama files' ``rotary_emb.inv_freq`` only when it equals the
frequencies our RoPE computes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from hybrid.hf import convert as gpt2
from hybrid.hf import llama_weights as llama
from hybrid.hf.llama_config import check_llama_config
from hybrid.hf.llama_flags import dropout_note
from models.config import GPTConfig


def is_norm_weight(name: str) -> bool:
    """A norm's scale (``ln1``, ``ln2``, ``ln_f``, ``q_norm``, ``k_norm`` weights): with
    ``--apply-layernorm-1p`` the model stores ``w`` of the scale ``1 + w`` and Hugging Face files
    hold the scale itself."""
    return name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight", "q_norm.weight",
                          "k_norm.weight"))


def read_hf_config(hf_dir: str | os.PathLike) -> dict:
    """``HF_DIR/config.json`` as a dict.

    Raises:
        FileNotFoundError: no such directory or no ``config.json`` in it.
    """
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    return json.loads(path.read_text())


_VALID = ("valid: model.safetensors, or model.safetensors.index.json with every shard it "
          "lists")


def _weight_files(hf_dir: Path) -> list[Path]:
    """The safetensors files holding the weights: the shards the index lists, else
    ``model.safetensors``.

    Raises:
        FileNotFoundError: no weights, pickle weights only, or a shard the index lists is not
            there; each names the directory and what is valid.
        ValueError: an index that is not JSON with a ``weight_map``.
    """
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a safetensors index (JSON with a weight_map of "
                             f"tensor -> shard): {type(e).__name__}: {e}") from None
        missing = [f for f in files if not (hf_dir / f).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{hf_dir}: model.safetensors.index.json lists {', '.join(missing[:3])}"
                + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
                + f", not in the directory ({len(missing)} of {len(files)} shards missing); "
                + _VALID)
        return [hf_dir / f for f in files]
    if (hf_dir / "model.safetensors").is_file():
        return [hf_dir / "model.safetensors"]
    pickled = sorted(p.name for p in hf_dir.glob("*.bin"))
    if pickled:
        raise FileNotFoundError(
            f"{hf_dir} holds pickle weights only ({', '.join(pickled)}), which are not loaded "
            f"(unpickling runs code); {_VALID}: re-save it with transformers' "
            "model.save_pretrained(DIR, safe_serialization=True)")
    held = ", ".join(sorted(p.name for p in hf_dir.iterdir())) or "nothing"
    raise FileNotFoundError(f"{hf_dir} has no weights (it holds {held}); {_VALID}")


def _headers(path: Path) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` of safetensors file ``path`` (its header only).

    Raises:
        ValueError: a file safetensors cannot read (truncated, not safetensors), named.
    """
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as e:  # safetensors' own error type is not importable on every version
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from None


def start_note(hf_dir: str | os.PathLike, config: GPTConfig) -> str | None:
    """The start-up note of ``--init-from-hf`` when the run's dropout differs from a Llama /
    Qwen2 / Qwen3 config.json's (:func:`hybrid.hf.llama_flags.dropout_note`); None otherwise.
    """
    hf = read_hf_config(hf_dir)
    return None if hf.get("model_type") == "gpt2" else dropout_note(hf, config)


_ROWS = 1024  # rows per block when a tied head is compared with the embedding


def check_config(hf: dict, config: GPTConfig, where: str = "config.json") -> None:
    """Check that ``hf`` (a ``config.json``: GPT-2, Llama, Qwen2 or Qwen3) describes ``config``.

    Raises:
        ValueError (UnsupportedModelError / UnsupportedHFSetting among them): the first setting
            that differs or that we cannot hold, named.
    """
    if hf.get("model_type") == "gpt2":
        gpt2.check_hf_config(hf, config, where)
    else:
        check_llama_config(hf, config, where)


class _Family:
    """One model family's names and layouts, as :class:`HFWeights` uses them."""

    def __init__(self, model_type: str, config: GPTConfig):
        self.gpt2, self.config = model_type == "gpt2", config
        self.embed = "transformer.wte.weight" if self.gpt2 else "model.embed_tokens.weight"
        self.params = (gpt2.parameter_names(config) if self.gpt2
                       else llama.parameter_names(config))

    def canonical(self, key: str) -> str:
        """GPT-2 files may omit the ``transformer.`` prefix."""
        if self.gpt2 and not key.startswith(("transformer.", "lm_head.")):
            return "transformer." + key
        return key

    def keys(self, name: str) -> list[str]:
        return [gpt2.hf_name(name)] if self.gpt2 else llama.hf_keys(name)

    def build(self, name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        t = (gpt2.from_hf(name, tensors[0], self.config) if self.gpt2
             else llama.from_hf(name, tensors, self.config))
        if self.config.apply_layernorm_1p and is_norm_weight(name):  # --apply-layernorm-1p
            return t - 1  # stores w of the scale 1 + w; the file holds the scale
        return t

    def derived(self, key: str) -> bool:
        """A stored tensor that is no weight: GPT-2's causal masks, Llama's inv_freq."""
        return bool(gpt2._HF_BUFFERS.match(key) if self.gpt2 else llama.ROTARY_BUFFER.match(key))


class HFWeights:
    """Our full tensors (``GPT.named_parameters()`` names, fp32) read from an HF directory.

    Call it with a name: ``source("layers.0.attn.qkv.weight") -> [(a + 2G) d, h]``.

    Args:
        hf_dir: a directory written by ``save_pretrained`` (or ``hybrid.export_hf``), sharded
            or not.
        config: the model the weights go into; ``config.json`` must describe it.
        where: how a config.json difference names the directory (default: its path).

    Raises:
        FileNotFoundError: missing config or weights.
        ValueError: see :func:`check_config`; a tensor our model has no place for (it would be
            dropped); a tied model's differing ``lm_head.weight``; a parameter missing from the
            files; a tensor whose shape differs from ours (the first one, named, with both
            shapes).
    """

    def __init__(self, hf_dir: str | os.PathLike, config: GPTConfig, where: str | None = None):
        self.dir, self.config = Path(hf_dir), config
        hf = read_hf_config(hf_dir)
        check_config(hf, config, where=where or str(self.dir / "config.json"))
        self.family = _Family(hf.get("model_type"), config)
        self._where: dict[str, tuple[str, str]] = {}  # HF key -> (file, key in the file)
        self._shapes: dict[str, tuple[int, ...]] = {}
        for path in _weight_files(self.dir):
            for key, shape in _headers(path).items():
                self._where[self.family.canonical(key)] = (str(path), key)
                self._shapes[self.family.canonical(key)] = shape
        self._check_complete()
        self._check_shapes()

    def _check_complete(self) -> None:
        owner = {k: n for n in self.family.params for k in self.family.keys(n)}
        missing = [k for k in owner if k not in self._where]
        if missing:
            raise ValueError(f"{self.dir}: no tensor {missing[0]!r} for our parameter "
                             f"{owner[missing[0]]!r} ({len(missing)} missing in all)")
        wanted = set(owner)
        for key in sorted(set(self._where) - wanted):
            if key == "lm_head.weight" and self.config.tied:
                self._check_tied_head()
            elif self.family.derived(key):
                self._check_derived(key)
            else:
                raise ValueError(f"{self.dir}: tensor {key!r} has no place in this run's model "
                                 "and would be dropped; refusing (does config.json describe "
                                 "the files?)")

    def _check_tied_head(self) -> None:
        """A tied model's saved ``lm_head.weight`` must equal the embedding, bitwise."""
        shape = self._shapes["lm_head.weight"]
        rows = shape[0] if shape == self._shapes[self.family.embed] else -1
        for lo in range(0, max(rows, 0), _ROWS):
            if not torch.equal(self._read("lm_head.weight", lo, lo + _ROWS),
                               self._read(self.family.embed, lo, lo + _ROWS)):
                rows = -1
                break
        if rows < 0:
            raise ValueError(f"{self.dir}: lm_head.weight differs from {self.family.embed}, but "
                             "this run ties them and would drop it: give "
                             "--untie-embeddings-and-output-weights")

    def _check_derived(self, key: str) -> None:
        if self.family.gpt2:
            return  # the causal mask: a constant
        stored, ours = self._read(key).float(), self.config.rotary().inv_freq()
        if stored.shape != ours.shape or not torch.allclose(stored, ours, rtol=1e-5, atol=0):
            raise ValueError(f"{self.dir}: {key} differs from the RoPE frequencies of this "
                             "run's --rotary-base / --use-rope-scaling; refusing to drop it")

    def _check_shapes(self) -> None:
        """Compare every stored shape with ours before any tensor is read; name the first
        mismatch."""
        from models.gpt import GPT

        with torch.device("meta"):
            ours = dict(GPT(self.config).named_parameters())
        for name in self.family.params:
            keys = self.family.keys(name)
            stored = [self._shapes[k] for k in keys]
            try:
                want = tuple(self.family.build(
                    name, [torch.empty(s, device="meta") for s in stored]).shape)
            except RuntimeError:  # not even reshapeable into our layout
                want = None
            if want != tuple(ours[name].shape):
                shapes = " and ".join(f"{k} has shape {list(s)}" for k, s in zip(
                    keys, stored, strict=True))
                raise ValueError(f"{self.dir}: {shapes}, which gives {name} shape "
                                 f"{list(want) if want else '(none)'}; our model has "
                                 f"{list(ours[name].shape)}")

    def _read(self, key: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """HF tensor ``key`` (rows ``lo:hi``), its file opened for this read only: no mapping
        stays resident after it."""
        path, k = self._where[key]
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(k) if lo is None else f.get_slice(k)[lo:hi]

    def names(self) -> list[str]:
        """Our parameter names this source provides (every one of the model's)."""
        return list(self.family.params)

    def __call__(self, name: str) -> torch.Tensor:
        """Our full fp32 tensor ``name``, contiguous."""
        if name not in self.family.params:
            raise KeyError(f"{self.dir} has no tensor for our parameter {name!r}")
        parts = [self._read(k) for k in self.family.keys(name)]
        return self.family.build(name, parts).float().contiguous()
