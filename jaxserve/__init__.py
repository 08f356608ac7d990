"""jaxserve: serve large language models with JAX.

`jaxserve.LLM` (the offline API) is imported on first use: it pulls in jax and the model, and
`checkpoints` imports `jaxserve.config`, so importing it eagerly here would be circular.
"""

from jaxserve.types import CompletionOutput, RequestOutput, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from jaxserve.engine.llm import LLM
        return LLM
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
