"""The README is a front door and ``docs/`` stays true to the code: every flag they name exists.

Each command's flags are read from the parsers it really builds: the command runs as
``__main__`` in a fresh interpreter with ``argparse`` stopped at its first ``parse_known_args``,
and every parser constructed until then is collected. In a code block a flag belongs to the
command before it on its (backslash-continued) line; in prose it must belong to some command.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# What the docs run: python -m <module>, the console scripts, the scripts/ programs, torchrun.
MODULES = [
    "hybrid.pretrain", "hybrid.plan", "hybrid.consolidate", "hybrid.export_hf", "hybrid.generate",
    "hybrid.plot_metrics", "data.preprocess", "data.train_tokenizer", "data.build_corpus",
    "data.merge", "torch.distributed.run",
]
CONSOLE = {"hybrid-pretrain": "hybrid.pretrain", "hybrid-plan": "hybrid.plan",
           "torchrun": "torch.distributed.run"}
# Flags of other programs that the prose names (pip's, in a TORCH_SPEC value; SLURM's sbatch and
# scancel).
FOREIGN = {"--index-url", "--signal"}

_COLLECT = r"""
import argparse, json, runpy, sys
from pathlib import Path

class _Stop(Exception):
    pass

made = []
init = argparse.ArgumentParser.__init__
def record(self, *a, **k):
    init(self, *a, **k)
    made.append(self)
def stop(self, *a, **k):
    raise _Stop
argparse.ArgumentParser.__init__ = record
argparse.ArgumentParser.parse_known_args = stop
out = {}
for target in sys.argv[1:]:
    made.clear()
    sys.argv = [target]
    try:
        if target.endswith(".py"):
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except (_Stop, SystemExit):  # a script that refuses this machine (no GPU) before parsing
        pass
    out[target] = sorted({s for p in made for a in p._actions for s in a.option_strings
                          if s.startswith("--")})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def flags_by_command() -> dict[str, set[str]]:
    scripts = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "scripts").glob("*.py"))
               if "__main__" in p.read_text()]  # programs, not their helper modules
    out = subprocess.run([sys.executable, "-c", _COLLECT, *MODULES, *scripts], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = {k: set(v) for k, v in json.loads(out.stdout.splitlines()[-1]).items()}
    # Megatron-LM's flags that hybrid.pretrain answers without a field (meaning, no-op, refusal)
    from hybrid.job import megatron_flags as mf
    found["hybrid.pretrain"] |= (set(mf.MEANING) | set(mf.SIZE_ONE) | mf.NO_OP | set(mf.REFUSED)
                                 | {"--tokenizer-type"})
    # the shell scripts' own options: tested as `[ "$1" = "--fast" ]` (scripts/test.sh)
    found["scripts/*.sh"] = {m for p in (ROOT / "scripts").glob("*.sh")
                             for m in re.findall(r'= "(--[a-z][a-z0-9-]*)"', p.read_text())}
    empty = [k for k, v in found.items() if not v and "gpu" not in k]
    assert not empty, f"no parser seen for {empty}"
    return found


def _command_of(token: str) -> str | None:
    if token in CONSOLE:
        return CONSOLE[token]
    if token.startswith("scripts/") and token.endswith(".py"):
        return token
    return token if token in MODULES else None


def _code_lines(text: str):
    """(line, in_code_block) pairs, code lines joined across trailing backslashes."""
    in_code, pending = False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_code, pending = not in_code, ""
            continue
        if not in_code:
            yield line, False
            continue
        pending += line.split("  #")[0].rstrip("\\") + " "
        if not line.rstrip().endswith("\\"):
            yield pending, True
            pending = ""


def unknown_flags(text: str, known: dict[str, set[str]]) -> list[str]:
    """Flags in ``text`` that the command they belong to does not take."""
    everyone = set().union(*known.values()) | FOREIGN
    bad = []
    for line, code in _code_lines(text):
        command = None
        for token in line.replace("`", " ").split():
            flag = re.fullmatch(r"(--[a-z][a-z0-9_-]*)(=.*)?[,.;:)]*", token)
            if flag:
                pool = known[command] if code and command else everyone
                if flag.group(1) not in pool:
                    bad.append(f"{flag.group(1)} ({command or 'prose'}): {line.strip()[:80]}")
            elif code and _command_of(token):
                command = _command_of(token)
            elif code and token.startswith("scripts/") and token.endswith(".sh"):
                command = "hybrid.pretrain"  # the launch scripts pass their flags through
    return bad


def test_every_flag_named_in_the_docs_exists(flags_by_command):
    assert "--tensor-model-parallel-size" in flags_by_command["hybrid.pretrain"]
    bad = {str(p.relative_to(ROOT)): u for p in DOCS
           if (u := unknown_flags(p.read_text(), flags_by_command))}
    assert not bad, bad


def test_an_unknown_flag_is_caught(flags_by_command):
    text = ("```bash\npython -m hybrid.plan --num-gpus 8 \\\n    --zero-stage 2\n```\nuse "
            "`--no-such-flag`\n")
    assert unknown_flags(text, flags_by_command) == ["--no-such-flag (prose): use `--no-such-flag`"]
    wrong = "```bash\npython -m hybrid.plan --save x\n```\n"
    assert unknown_flags(wrong, flags_by_command) == [
        "--save (hybrid.plan): python -m hybrid.plan --save x"]


def test_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 120
    for doc in ("docs/training.md", "docs/memory.md", "docs/performance.md", "docs/interop.md"):
        assert f"({doc})" in readme and (ROOT / doc).is_file(), doc
    assert "bash scripts/quickstart.sh" in readme and "bash scripts/test.sh" in readme


def test_readme_package_map_names_every_package():
    """Each package of ``hybrid/`` and each top-level code folder has a row; every row exists."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Package map"):readme.index("## Documentation")]
    named = {row.split("`")[1].rstrip("/") for row in table.splitlines() if row.startswith("| `")}
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "hybrid").glob("*/__init__.py")}
    assert packages | {"models", "data", "scripts"} <= named, "packages missing from the map"
    assert all((ROOT / n).is_dir() for n in named), "the map names folders that do not exist"


def test_every_fast_entry_names_a_test_that_exists():
    """``scripts/test.sh --fast`` is the loop developers run: a renamed test in its list would
    fail it with "not found" (or, as a file, run nothing of what was meant)."""
    text = (ROOT / "scripts" / "test.sh").read_text()
    entries = text[text.index("FAST=(") + 6:text.index(")", text.index("FAST=("))].split()
    assert len(entries) >= 20
    for entry in entries:
        path, _, name = entry.partition("::")
        assert (ROOT / path).is_file(), entry
        if name:
            assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), entry
