"""One call that loads what every entry point needs: the model, its config and its tokenizer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import checkpoints
from jaxserve.config import ModelConfig
from jaxserve.model.llama import Llama
from jaxserve.tokenizer import Tokenizer


@dataclasses.dataclass
class LoadedModel:
    model: Llama
    config: ModelConfig
    tokenizer: Tokenizer
    source: Path
    format: str  # "hf" or "gguf"
    load_s: float

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the config and the tokenizer together (chat models often end on both)."""
        return tuple(sorted(set(self.config.eos_token_ids) | set(self.tokenizer.eos_token_ids)))


def load_tokenizer(loaded: checkpoints.LoadedParams) -> Tokenizer:
    if loaded.format == "gguf":
        return Tokenizer.from_gguf_metadata(loaded.gguf_metadata)
    return Tokenizer.from_hf_folder(loaded.source)


def load(model: str | Path | None = None, dtype: str = "float32") -> LoadedModel:
    import time
    t0 = time.perf_counter()
    llama, loaded = checkpoints.load_model(model, dtype)
    tokenizer = load_tokenizer(loaded)
    return LoadedModel(llama, loaded.config, tokenizer, loaded.source, loaded.format,
                       time.perf_counter() - t0)
