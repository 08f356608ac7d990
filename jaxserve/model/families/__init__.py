"""One module per model family; importing this package registers them all
(jaxserve/model/family.py explains what a family module holds)."""

from jaxserve.model.families import gemma, llama, mistral, mixtral, phi3, qwen2, qwen3, qwen3_moe  # noqa: F401
