"""Load a GGUF file (llama.cpp's format) through the `gguf` package.

The model config, tokenizer and chat template come from the file's metadata. Tensors are
dequantized to fp32 (F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K are accepted) and renamed to HF names,
then go through the same name table as HF folders, so both formats share one mapping.

llama.cpp stores the q/k projections of `llama`-architecture models permuted for interleaved
(adjacent-pair) RoPE; we use HF's rotate-half RoPE, so those rows are un-permuted on load
(models.md gives the formula). Qwen2 GGUFs use NeoX RoPE already and are not permuted.

The raw quantized blocks stay reachable (`GGUFCheckpoint.raw_tensor`) for loading Q8_0/Q4_1
straight into int8/int4 kernels without a float round trip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from checkpoints import progress
from checkpoints.errors import CheckpointError
from checkpoints.name_table import hf_to_params
from jaxserve.config import ConfigError, ModelConfig
from jaxserve.model import family

Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K}

# GGUF tensor names come from the family's table (jaxserve/model/family.py); the family is
# found by general.architecture (Mistral GGUFs say "llama" and load as Llama).


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE -> HF rotate-half)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _f32_to_decimal(v: float) -> float:
    """GGUF stores floats as f32 (1e-5 reads back as 9.9999997e-06); recover the short decimal
    the model was published with, so a converted config.json matches the original."""
    return float(str(np.float32(v)))


class GGUFCheckpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file")
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # the gguf package raises bare ValueErrors/struct errors
            raise CheckpointError(f"{self.path}: unreadable GGUF file ({e})") from None
        self.metadata: dict[str, Any] = {k: f.contents() for k, f in self.reader.fields.items()}
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.config = self._config()

    def _meta(self, key: str, default: Any = ...) -> Any:
        if key in self.metadata:
            return self.metadata[key]
        if default is ...:
            raise CheckpointError(f"{self.path}: metadata key {key!r} missing")
        return default

    def _config(self) -> ModelConfig:
        arch = self._meta("general.architecture")
        fam = family.by_gguf(arch)
        if fam is None:
            supported = sorted(f.gguf_arch for f in family.families().values() if f.gguf_arch)
            raise CheckpointError(f"{self.path}: general.architecture {arch!r} is not supported; "
                                  f"supported: {supported}")
        self.family = fam
        if "rope_freqs.weight" in self.tensors:
            raise CheckpointError(f"{self.path}: tensor 'rope_freqs.weight' (Llama 3.1 RoPE scaling "
                                  "baked into frequencies) is not supported for GGUF; convert the HF folder")
        a = arch
        n_heads = int(self._meta(f"{a}.attention.head_count"))
        hidden = int(self._meta(f"{a}.embedding_length"))
        vocab = self._meta(f"{a}.vocab_size", None)
        if vocab is None:
            vocab = len(self._meta("tokenizer.ggml.tokens"))
        eos = self._meta("tokenizer.ggml.eos_token_id", None)

        def meta(key, default=...):  # a family hook's view: keys without the arch prefix
            return self._meta(f"{a}.{key}", default)
        try:
            kw = dict(
                architecture=fam.name,
                vocab_size=int(vocab),
                hidden_size=hidden,
                intermediate_size=int(self._meta(f"{a}.feed_forward_length")),
                num_layers=int(self._meta(f"{a}.block_count")),
                num_heads=n_heads,
                num_kv_heads=int(self._meta(f"{a}.attention.head_count_kv", n_heads)),
                head_dim=int(self._meta(f"{a}.attention.key_length", hidden // n_heads)),
                max_position_embeddings=int(self._meta(f"{a}.context_length")),
                rms_norm_eps=_f32_to_decimal(self._meta(f"{a}.attention.layer_norm_rms_epsilon")),
                rope_theta=_f32_to_decimal(self._meta(f"{a}.rope.freq_base", 10000.0)),
                tie_word_embeddings="output.weight" not in self.tensors,
                attention_bias="blk.0.attn_q.bias" in self.tensors,
                bos_token_id=self._meta("tokenizer.ggml.bos_token_id", None),
                eos_token_ids=(int(eos),) if eos is not None else (),
            )
            kw.update(fam.from_gguf(meta))
            return ModelConfig(**kw)
        except ConfigError as e:
            raise CheckpointError(f"{self.path}: {e}") from None

    def raw_tensor(self, name: str) -> tuple[Q, tuple[int, ...], np.ndarray]:
        """(quantization type, logical shape [rows, cols], raw block bytes) of one tensor."""
        t = self.tensors[name]
        return Q(t.tensor_type), tuple(int(x) for x in reversed(t.shape)), t.data

    def dequantized(self, name: str) -> np.ndarray:
        """One tensor in fp32 with its logical [rows, cols] (HF) shape."""
        t = self.tensors[name]
        qtype = Q(t.tensor_type)
        if qtype not in SUPPORTED_TYPES:
            raise CheckpointError(f"GGUF tensor {name!r}: quantization {qtype.name} is not supported; "
                                  f"supported: {sorted(q.name for q in SUPPORTED_TYPES)}")
        w = gguf.quants.dequantize(t.data, qtype).astype(np.float32, copy=False)
        shape = tuple(int(x) for x in reversed(t.shape))
        return w.reshape(shape)

    def expert_raw(self, hf_name: str) -> tuple[Q, tuple[int, ...], np.ndarray] | None:
        """raw_tensor of one MoE expert's matrix (its slice of the fused 3-D tensor: experts
        lead, so its blocks are one contiguous run), or None if hf_name is not an expert's."""
        e = self._expert_index.get(hf_name)
        if e is None:
            return None
        qtype, shape, raw = self.raw_tensor(self._hf_to_gguf[hf_name])
        return qtype, shape[1:], np.ascontiguousarray(raw).reshape(shape[0], -1)[e]

    def hf_tensor(self, hf_name: str) -> np.ndarray:
        """A tensor by its HF name, dequantized and (for llama q/k) un-permuted; Gemma's norms
        as HF holds them (w, not 1 + w); a MoE expert's matrix sliced from its fused tensor."""
        self._hf_to_gguf  # noqa: B018  (builds the name maps)
        progress.tick(len(self._hf_to_gguf))
        gname = self._hf_to_gguf[hf_name]
        if hf_name in self._expert_index:
            if self._fused_cache[0] != gname:  # the E experts of a tensor are read in a row
                self._fused_cache = (gname, self.dequantized(gname))
            return self._fused_cache[1][self._expert_index[hf_name]]
        w = self.dequantized(gname)
        if hf_name in self._norm1:
            # llama.cpp stores Gemma's norms as 1 + w; HF names hold w, and the table adds 1 back:
            # (v - 1) + 1 == v exactly for v >= 0.5 (Sterbenz), within 6e-8 below that.
            w = w - np.float32(1)
        if self.family.gguf_permuted_qk:
            if hf_name.endswith("q_proj.weight"):
                w = unpermute_rope_rows(w, self.config.num_heads)
            elif hf_name.endswith("k_proj.weight"):
                w = unpermute_rope_rows(w, self.config.num_kv_heads)
        return w

    @property
    def _hf_to_gguf(self) -> dict[str, str]:
        if not hasattr(self, "_name_map"):
            known = family.gguf_to_hf_names(self.config)
            experts = family.gguf_expert_names(self.config)
            unknown = sorted(set(self.tensors) - set(known) - set(experts))
            if unknown:
                raise CheckpointError(f"GGUF tensor {unknown[0]!r} has no known HF name (unsupported tensor "
                                      f"for a {self.config.architecture} model with this config)")
            self._name_map = {known[n]: n for n in self.tensors if n in known}
            self._expert_index: dict[str, int] = {}
            self._fused_cache: tuple = (None, None)
            for n in self.tensors:
                for e, hf in enumerate(experts.get(n, ())):
                    self._name_map[hf], self._expert_index[hf] = n, e
            self._norm1 = {p.hf.format(i=i) for p in family.table(self.config) if p.layout == "norm1"
                           for i in range(self.config.num_layers)}
        return self._name_map

    def hf_tensors(self) -> dict[str, np.ndarray]:
        """Every tensor in fp32 under its HF name (what `jaxserve convert` writes)."""
        return {n: self.hf_tensor(n) for n in self._hf_to_gguf}


def load_gguf_params(path: str | Path) -> tuple[GGUFCheckpoint, dict[str, np.ndarray]]:
    ckpt = GGUFCheckpoint(path)
    return ckpt, hf_to_params(ckpt.config, set(ckpt._hf_to_gguf), ckpt.hf_tensor)
