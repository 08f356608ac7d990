"""The design card's import arrows (docs/architecture.md) hold: import-linter checks the
contracts in pyproject.toml, so a forbidden import fails the suite."""

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
