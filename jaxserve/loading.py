"""One call that loads what every entry point needs: the model, its config and its tokenizer."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import checkpoints
from jaxserve import host_memory
from jaxserve.config import ModelConfig
from jaxserve.model.llama import Llama
from jaxserve.tokenizer import Tokenizer

log = logging.getLogger("jaxserve.loading")


@dataclasses.dataclass
class LoadedModel:
    model: Llama
    config: ModelConfig
    tokenizer: Tokenizer
    source: Path
    format: str  # "hf" or "gguf"
    load_s: float
    load_memory: host_memory.PeakRSS | None = None  # peak resident host memory during the load

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the config and the tokenizer together (chat models often end on both)."""
        return tuple(sorted(set(self.config.eos_token_ids) | set(self.tokenizer.eos_token_ids)))


def load_tokenizer(loaded: checkpoints.LoadedParams) -> Tokenizer:
    if loaded.format == "gguf":
        return Tokenizer.from_gguf_metadata(loaded.gguf_metadata)
    return Tokenizer.from_hf_folder(loaded.source)


def load(model: str | Path | None = None, dtype: str = "float32", mesh=None) -> LoadedModel:
    """Loads, measuring (and logging) the peak host memory of the load: `lm.load_memory`. On
    CPU the "devices" are host memory too, so what they hold counts in it."""
    import jax

    from jaxserve.model.llama import flat_params
    with host_memory.peak_during() as mem:
        lm = _load(model, dtype, mesh)
        jax.block_until_ready(flat_params(lm.model))  # every read and copy inside the span
    lm.load_memory = mem
    log.info("loaded %s in %.1f s; %s", lm.source.name, lm.load_s, mem.describe())
    return lm


def _load(model: str | Path | None, dtype: str, mesh) -> LoadedModel:
    """With a tensor-parallel mesh, an HF folder is read shard by shard (each process reads only
    its devices' slices, checkpoints/sharded.py); a GGUF file is dequantized whole on the host
    (its blocks do not slice by rows of the un-permuted layout) and split afterwards."""
    import time
    t0 = time.perf_counter()
    path = checkpoints.resolve_model_path(model)
    if mesh is not None and mesh.shape["tp"] > 1 and path.is_dir():
        from checkpoints.hf import read_hf_config
        from checkpoints.sharded import load_hf_sharded
        llama = load_hf_sharded(path, dtype, mesh)
        tokenizer = Tokenizer.from_hf_folder(path)
        return LoadedModel(llama, read_hf_config(path), tokenizer, path, "hf", time.perf_counter() - t0)
    llama, loaded = checkpoints.load_model(path, dtype)
    tokenizer = load_tokenizer(loaded)
    return LoadedModel(llama, loaded.config, tokenizer, loaded.source, loaded.format,
                       time.perf_counter() - t0)
