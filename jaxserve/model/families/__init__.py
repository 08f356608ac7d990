"""One module per model family; importing this package registers them all
(jaxserve/model/family.py explains what a family module holds)."""

from jaxserve.model.families import llama, mistral, qwen2  # noqa: F401
