"""Join preprocessed shards into one indexed dataset: ``python -m data.merge``.

Example::

    python -m data.merge --input runs/data/shard0_text_document runs/data/shard1_text_document \\
        --output-prefix runs/data/all_text_document

``--input`` takes prefixes (``.bin/.idx`` pairs, extension optional) or directories; a
directory contributes every pair inside it in sorted name order. Shards are joined in the
order given, and the result is byte-identical to preprocessing the concatenated input.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from data.indexed_dataset import merge_datasets


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
    p.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.idx")
    a = p.parse_args(argv)
    try:
        prefixes = resolve_prefixes(a.input)
        ds = merge_datasets(prefixes, a.output_prefix)
    except (OSError, ValueError) as e:  # a missing or unreadable shard: one line, nothing written
        p.exit(2, f"{p.prog}: error: {e}\n")
    print(
        f"merged {len(prefixes)} shards into {a.output_prefix}: "
        f"{len(ds.document_indices) - 1} documents, {ds.num_tokens} tokens"
    )


if __name__ == "__main__":
    main()
