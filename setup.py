"""Builds the native CPU attention kernel (pallas_kernels/native/*.cc, an XLA FFI custom call)
as a compiled extension at install time: `make setup` (pip install -e .) or any pip install
runs this. Everything else about the package is in pyproject.toml.

The extension is optional: where it cannot be built (no C++ compiler, no jaxlib headers in the
build environment) the install goes on without it, and attention_impl="auto" uses "xla" on the
CPU and says why once at start-up (pallas_kernels/ragged_paged_attention/cpu_native.py).

The library carries the hash of the kernel's source it was built from; the loader refuses a
library built from another source (an edited .cc needs `make setup` or
`python setup.py build_ext --inplace` again), never running stale code.

-march=native: the build is for the installing machine's CPU (the kernel's AVX-512 / AVX2
paths). Set JAXSERVE_NATIVE_MARCH (e.g. x86-64-v3) when building a wheel for other machines.
-ffp-contract=off: the kernels' FMAs are the ones their intrinsics ask for, none added by the
compiler, which fuses a scalar a * b + c or not by the -mtune a -march implies (GCC's znver
tunings leave FMA chains unfused): with it, the attention's and the matmul's outputs are
bit-identical on the AVX2 and AVX-512 builds and across tunings (`make test-native-avx2`'s
test_outputs_are_bit_identical_across_builds, test_packed_is_bit_identical_across_builds);
without it the attention parts' merge differed in ~7% of a prefill's outputs by an ulp or so.
"""

import hashlib
import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
NATIVE = Path("pallas_kernels") / "native"
KERNEL = NATIVE / "ragged_paged_attention_cpu.cc"
MATMUL = NATIVE / "small_matmul_cpu.cc"


def source_hash(kernel: Path = KERNEL) -> str:
    """Must equal the loader's source_hash() (ragged_paged_attention.cpu_native,
    sharding.native_matmul): sha256 of the kernel source, 16 hex."""
    return hashlib.sha256((HERE / kernel).read_bytes()).hexdigest()[:16]


class OptionalBuildExt(build_ext):
    """Adds jaxlib's FFI headers at build time (jaxlib is a build requirement), and lets the
    install go on, with a message, where the kernel cannot be built."""

    def build_extension(self, ext):
        try:
            import jax.ffi
            include = jax.ffi.include_dir()
        except Exception as e:  # jax/jaxlib missing or too old in the build environment
            try:
                import jaxlib
                include = str(Path(jaxlib.__file__).parent / "include")
            except Exception:
                print(f"jaxserve: not building the native CPU attention kernel: no jaxlib headers ({e}); "
                      f"attention_impl='auto' will use 'xla' on the CPU")
                return
        ext.include_dirs.append(include)
        try:
            super().build_extension(ext)
        except Exception as e:
            print(f"jaxserve: building the native CPU attention kernel failed ({e}); "
                  f"attention_impl='auto' will use 'xla' on the CPU")


march = os.environ.get("JAXSERVE_NATIVE_MARCH", "native")


def native_extension(name: str, kernel: Path) -> Extension:
    """One kernel source as pallas_kernels.native.<name>, stamped with its source hash
    (native/build_info.h, which each kernel includes)."""
    return Extension(
        f"pallas_kernels.native.{name}",
        sources=[str(kernel)],
        depends=[str(NATIVE / "build_info.h")],
        define_macros=[("JAXSERVE_SOURCE_HASH", f'"{source_hash(kernel)}"')],
        extra_compile_args=["-O3", f"-march={march}", "-ffp-contract=off", "-std=c++17", "-pthread"],
        extra_link_args=["-pthread"],
        language="c++",
        optional=True,
    )


setup(
    ext_modules=[native_extension("_ragged_paged_attention_cpu", KERNEL),
                 native_extension("_small_matmul_cpu", MATMUL)],
    cmdclass={"build_ext": OptionalBuildExt},
)
