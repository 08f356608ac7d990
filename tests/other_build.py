"""For the tests that hold the other build a `make test-native-avx2` leg loads (conftest.py,
JAXSERVE_TEST_NATIVE_DIR) equal to the installed build bit for bit: the installed build's outputs
come from a subprocess, since both libraries register the same FFI target names and a process
holds one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parent

only_in_the_other_build_leg = pytest.mark.skipif(
    not os.environ.get("JAXSERVE_TEST_NATIVE_DIR"),
    reason="compares another build of the native kernels (make test-native-avx2's) with the installed one")


def assert_bit_identical_to_installed_build(outputs: Callable[[], np.ndarray], loader: ModuleType,
                                            tmp_path: Path) -> None:
    """`outputs()` (a module-level function of a test module) under this process's build equals
    it under the installed build, bit for bit; `loader` (the kernel's cpu_native module) must
    name a different library in each."""
    out = tmp_path / "installed.npy"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXSERVE_TEST_NATIVE")}
    code = (f"import sys; sys.path[:0] = [{str(TESTS)!r}, {str(TESTS.parent)!r}]; import numpy as np; "
            f"import {outputs.__module__} as t, {loader.__name__} as loader; "
            f"np.save({str(out)!r}, t.{outputs.__name__}()); print(loader.library_path())")
    run = subprocess.run([sys.executable, "-c", code], env=env, timeout=300, capture_output=True, text=True)
    assert run.returncode == 0, f"the installed build's run failed (exit {run.returncode}):\n{run.stderr[-4000:]}"
    installed_library = Path(run.stdout.strip().splitlines()[-1])
    assert installed_library.resolve() != loader.library_path().resolve(), "the same library twice proves nothing"
    np.testing.assert_array_equal(outputs(), np.load(out))
