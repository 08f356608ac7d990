"""The GPU compile group (`make gpu-compile`): XLA:GPU, ptxas and Mosaic GPU on compile-only
CUDA devices described by jaxserve/aot/gpu_specs/, no GPU. It runs in its own venv (.venv-gpu,
jax[cuda12]); anywhere the CUDA plugin is not installed every test here is skipped with that
one reason."""

import importlib.util
import os

from aot_cases import skip_group_unless

# Before jax is imported: the CUDA plugin's start-up check would fail on the missing driver.
os.environ["JAX_PLATFORMS"] = "cpu"

HAVE_CUDA_PLUGIN = importlib.util.find_spec("jax_cuda12_plugin") is not None


def pytest_collection_modifyitems(config, items):
    skip_group_unless(HAVE_CUDA_PLUGIN, items, "gpu_compile", "jax[cuda12] is not installed here: `make gpu-compile` runs these in .venv-gpu")
