"""The TPU compile group (`make tpu-compile`): the real TPU compiler (libtpu) on compile-only
devices, no TPU. It runs in its own venv (.venv-tpu) so that libtpu never loads into the CPU
suite; anywhere libtpu is not installed every test here is skipped with that one reason."""

import importlib.util
import os

from aot_cases import skip_group_unless

# Before jax is imported: the CPU is this process's only backend (libtpu would look for a chip),
# and libtpu's one-process lock file is for chips, which compile-only devices never drive.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None


def pytest_collection_modifyitems(config, items):
    skip_group_unless(HAVE_LIBTPU, items, "tpu_compile", "libtpu is not installed here: `make tpu-compile` runs these in .venv-tpu")
