"""The design card's import arrows (docs/architecture.md) hold: import-linter checks the
contracts in pyproject.toml, so a forbidden import fails the suite."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    r = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "BROKEN" not in r.stdout and "KEPT" in r.stdout


def test_importing_jaxserves_bottom_runs_no_top():
    """Python runs jaxserve/__init__.py before any jaxserve module, so it must stay at the bottom
    too: `checkpoints` import jaxserve.config, and an eager `jaxserve.LLM` there would load the
    engine, the loader and checkpoints themselves half-way through checkpoints' own import (a
    cycle the module graph cannot show). A fresh interpreter: nothing heavy may come in."""
    code = ("import sys, jaxserve, jaxserve.config, jaxserve.types\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'numpy', 'checkpoints')"
            " or m.startswith(('jaxserve.engine', 'jaxserve.loading', 'jaxserve.server'))))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
