"""The installed native build's outputs, computed in a subprocess, for the tests that hold the
other build a `make test-native-avx2` leg loads (conftest.py, JAXSERVE_TEST_NATIVE_DIR) equal to
it bit for bit: both libraries register the same FFI target names, so a process holds one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parent

only_in_the_other_build_leg = pytest.mark.skipif(
    not os.environ.get("JAXSERVE_TEST_NATIVE_DIR"),
    reason="compares another build of the native kernels (make test-native-avx2's) with the installed one")


def installed_build_outputs(test_module: str, outputs: str, loader: str, tmp_path: Path) -> tuple[np.ndarray, Path]:
    """`test_module.outputs()` under the installed build, and the library that computed it
    (`test_module.loader.library_path()`)."""
    out = tmp_path / "installed.npy"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXSERVE_TEST_NATIVE")}
    code = (f"import sys; sys.path[:0] = [{str(TESTS)!r}, {str(TESTS.parent)!r}]; import numpy as np; "
            f"import {test_module} as t; np.save({str(out)!r}, t.{outputs}()); print(t.{loader}.library_path())")
    run = subprocess.run([sys.executable, "-c", code], env=env, timeout=300, capture_output=True, text=True)
    assert run.returncode == 0, f"the installed build's run failed (exit {run.returncode}):\n{run.stderr[-4000:]}"
    return np.load(out), Path(run.stdout.strip().splitlines()[-1])
