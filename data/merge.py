"""Join preprocessed shards into one indexed dataset: ``python -m data.merge``.

Example::

    python -m data.merge --input runs/data/shard0_text_document runs/data/shard1_text_document \\
        --output-prefix runs/data/all        # writes runs/data/all_text_document.{bin,idx}

``--input`` takes prefixes (``.bin/.idx`` pairs, extension optional) or directories; a
directory contributes every pair inside it in sorted name order. Shards are joined in the
order given, and the result is byte-identical to preprocessing the concatenated input.

The output is named as ``data.preprocess --output-prefix`` names its own: when every input ends
in the same ``_<key>_document`` (or ``_<key>_sentence``) that preprocess appended, the output
prefix gets it too, unless it already ends with it; the ``--data-path`` to train on is printed.
Inputs without a common suffix give ``<prefix>.bin/.idx`` as written (Megatron-LM's
``merge_datasets.py`` always does that).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from data.indexed_dataset import merge_datasets

_SUFFIX = re.compile(r"_[^_/]+_(document|sentence)$")


def output_name(prefixes: list[str], output_prefix: str) -> str:
    """The prefix ``data.merge`` writes: ``output_prefix`` plus the ``_<key>_<level>`` suffix
    every input shares (preprocess's naming), unless it already ends with it or the inputs share
    none."""
    suffixes = {m.group(0) if (m := _SUFFIX.search(Path(p).name)) else None for p in prefixes}
    suffix = suffixes.pop() if len(suffixes) == 1 else None
    if suffix is None or output_prefix.endswith(suffix):
        return output_prefix
    return output_prefix + suffix


def resolve_prefixes(inputs: list[str]) -> list[str]:
    """Expand directories to their sorted ``*.idx`` prefixes and strip ``.bin/.idx`` suffixes.

    Raises:
        FileNotFoundError: a directory holds no ``.idx`` file.
    """
    out: list[str] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(str(f.with_suffix("")) for f in p.glob("*.idx"))
            if not found:
                raise FileNotFoundError(f"no .idx files in directory {p}")
            out.extend(found)
        else:
            out.append(item[:-4] if item.endswith((".bin", ".idx")) else item)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m data.merge",
                                description="Merge indexed-dataset shards into one.")
    p.add_argument(
        "--input", nargs="+", required=True, help="shard prefixes or directories, in order"
    )
    p.add_argument("--output-prefix", required=True,
                   help="writes <prefix>_<key>_document.bin/.idx when every input ends in that "
                   "suffix (as preprocess names its output), else <prefix>.bin/.idx")
    a = p.parse_args(argv)
    try:
        prefixes = resolve_prefixes(a.input)
        out = output_name(prefixes, a.output_prefix)
        ds = merge_datasets(prefixes, out)
    except (OSError, ValueError) as e:  # a missing or unreadable shard: one line, nothing written
        p.exit(2, f"{p.prog}: error: {e}\n")
    print(
        f"merged {len(prefixes)} shards into {out}.bin/.idx: "
        f"{len(ds.document_indices) - 1} documents, {ds.num_tokens} tokens; train with "
        f"--data-path {out}"
    )


if __name__ == "__main__":
    main()
