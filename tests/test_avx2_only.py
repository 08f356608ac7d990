"""scripts/avx2_only/run.sh: a command run under it sees an AVX2-only CPU (CPUID masked), and
the program's own SIGSEGV handler still gets every fault that is not a CPUID."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "scripts" / "avx2_only" / "run.sh"


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


FLAGS = _cpu_flags()
pytestmark = [
    pytest.mark.skipif("cpuid_fault" not in FLAGS,
                       reason="this CPU (or its hypervisor) offers no CPUID faulting, which the tool needs"),
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the tool with"),
]

_FEATURES = r"""
#include <stdio.h>
int main(void) {
  __builtin_cpu_init();
  printf("%d %d %d\n", !!__builtin_cpu_supports("avx2"), !!__builtin_cpu_supports("fma"),
         !!__builtin_cpu_supports("avx512f"));
  return 0;
}
"""


def _run(*argv, masked: bool) -> subprocess.CompletedProcess:
    cmd = [str(RUN), *map(str, argv)] if masked else list(map(str, argv))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_a_program_sees_avx2_without_avx512(tmp_path):
    src = tmp_path / "features.c"
    src.write_text(_FEATURES)
    exe = tmp_path / "features"
    subprocess.run(["cc", "-O1", "-o", str(exe), str(src)], check=True, timeout=120)
    plain, masked = _run(exe, masked=False), _run(exe, masked=True)
    assert plain.returncode == 0 and masked.returncode == 0, masked.stderr
    # Unmasked, the program reads what the kernel reports; masked, AVX2 and FMA stay, AVX-512 goes.
    assert plain.stdout.split() == [str(int(f in FLAGS)) for f in ("avx2", "fma", "avx512f")]
    assert masked.stdout.split() == [str(int("avx2" in FLAGS)), str(int("fma" in FLAGS)), "0"]


def test_the_compiler_builds_for_avx2_under_it():
    # `make setup` builds the native kernels -march=native: under the tool that must be AVX2.
    out = _run("cc", "-march=native", "-Q", "--help=target", masked=True)
    assert out.returncode == 0, out.stderr
    enabled = {line.split()[0] for line in out.stdout.splitlines() if line.strip().endswith("[enabled]")}
    assert "-mavx512f" not in enabled
    assert ("-mavx2" in enabled) == ("avx2" in FLAGS)


def test_python_and_its_fault_handler_work_under_it():
    # JAX runs (XLA asks CPUID for its features at start-up), and a real segfault still reaches
    # Python's faulthandler, which the tool set aside rather than replaced.
    code = ("import faulthandler, ctypes, jax, jax.numpy as jnp; faulthandler.enable(); "
            "print(int(jax.jit(lambda x: x * 2)(jnp.int32(21))), flush=True); ctypes.string_at(0)")
    out = _run(sys.executable, "-c", code, masked=True)
    assert out.stdout.strip() == "42", out.stderr[-2000:]
    assert out.returncode != 0 and "Segmentation fault" in out.stderr, out.stderr[-2000:]
