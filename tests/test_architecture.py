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


def test_the_server_contract_forbids_every_other_jaxserve_module():
    """A module added to jaxserve later is behind the server's contract too, unless it is
    deliberately part of what the server may import (the engine's face, types, config)."""
    import tomllib
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    server = next(c for c in contracts if c.get("source_modules") == ["jaxserve.server"])
    forbidden = set(server["forbidden_modules"])
    allowed = {"server", "engine", "types", "config", "config_base", "config_engine", "__init__"}
    tops = {p.stem for p in (ROOT / "jaxserve").iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").exists()) and not p.name.startswith(".")}
    assert "jaxserve.engine.*" in forbidden
    missing = sorted(f"jaxserve.{m}" for m in tops - allowed if f"jaxserve.{m}" not in forbidden)
    assert not missing, f"add {missing} to the server's import contract in pyproject.toml"


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
