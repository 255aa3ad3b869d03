"""``scripts/setup_env.sh``, the quickstart's first step: what a new user sees of it."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_setup_keeps_setuptools_editable_banner_off_the_screen(tmp_path):
    """The quickstart's first screen was setuptools' "Editable installation ... be careful"
    banner framed in ``!!`` lines: setup_env.sh runs the editable install with a warning filter
    for exactly that message, and the filter holds where pip's build hook records the backend's
    warnings (``catch_warnings(record=True)``), while any other warning still shows."""
    record = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "PYTHONWARNINGS=$PYTHONWARNINGS $*" >> {record}\n')
    fake.chmod(0o755)
    env = dict(os.environ, VENV=str(tmp_path), TORCH_SPEC="")
    env.pop("PYTHONWARNINGS", None)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(fake)
    subprocess.run(["bash", str(ROOT / "scripts" / "setup_env.sh")], env=env, cwd=ROOT,
                   check=True, timeout=60, capture_output=True)
    (editable,) = [x for x in record.read_text().splitlines() if " -e " in x]
    setting = editable.split()[0].split("=", 1)[1]
    emit = ("import warnings\nfrom setuptools.warnings import InformationOnly\n"
            "with warnings.catch_warnings(record=True) as got:\n"
            "    InformationOnly.emit('Editable installation.', 'be careful')\n"
            "    warnings.warn('another warning')\n"
            "print([str(w.message).split(chr(10))[0] for w in got])")
    out = subprocess.run([sys.executable, "-c", emit], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONWARNINGS=setting), timeout=60, check=True)
    assert out.stdout.strip() == "['another warning']", (setting, out.stdout, out.stderr)
