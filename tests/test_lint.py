"""`ruff check .` is clean: the rule set in pyproject.toml ([tool.ruff]) catches bugs (undefined
and unused names, bugbear's traps, blocking calls in async code), not style."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    exe = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    r = subprocess.run([exe, "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
