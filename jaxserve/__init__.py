"""jaxserve: serve large language models with JAX.

This file runs before any jaxserve module, the bottom ones too (`jaxserve.config`, which
`checkpoints` imports), so it imports only the stdlib-only `jaxserve.types` and
`jaxserve.host_malloc`: `import jaxserve.config` pulls in no jax (tests/test_architecture.py
checks). `jaxserve.LLM`, the offline
API at the top of the layering (it loads checkpoints and builds the engine), is resolved on first
use (PEP 562), as vLLM does for its heavy top-level names.
"""

from jaxserve import host_malloc as _host_malloc
from jaxserve.types import CompletionOutput, RequestOutput, SamplingParams

# One malloc arena before JAX starts its CPU client and the threads that will malloc every
# step's temporaries (jaxserve/host_malloc.py): the earliest point a script's first JAX
# computation can follow. Stdlib only, like jaxserve.types.
_host_malloc.limit_arenas()

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from jaxserve.engine.llm import LLM
        return LLM
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
