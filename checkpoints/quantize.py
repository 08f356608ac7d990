"""Quantize-on-load (`--quantize int8|int4`): round-to-nearest from float weights, on the host.

  int8: symmetric, q = round(w / s) in [-127, 127], s = max|w| / 127 over the group (fp16
        scales) or over the whole output row with group_size=PER_CHANNEL (fp32 scales);
  int4: asymmetric, u = round((w - zero) / s) in 0..15, s = (max - min) / 15, zero = min
        (fp16 scales and zeros, GGUF Q4_1's form); u is computed against the fp16-rounded s
        and zero, so the stored triple is self-consistent.
Group size by default: int4 32 (GGUF's block; on SmolLM2 requantized to int4, g32 costs
+6% perplexity and g64 +44%, measured), int8 the largest of 128, 64, 32 dividing every input
width (SmolLM2: 64). Why groups for int8 too: on SmolLM2 they cut the weights' RMS error by a
quarter to a third against per-channel scales (rows whose maximum is far above most of their
blocks waste levels), for 2 bytes per group; per channel stays available (PER_CHANNEL).

Which weights: every projection (q, k, v, o, gate, up, down) and the LM head. With tied
embeddings the table is the LM head, so it is quantized (and `embedding_lookup` dequantizes
the rows it gathers); an untied input embedding stays float (gathering T rows reads little).
Norms and biases stay float. Layouts are described once, in pallas_kernels/quantized_matmul/
reference.py; weights are quantized in HF's [out, in] layout, which is the storage layout, so
no transposes are involved.

`build_params` walks the name table (checkpoints/name_table.py) like `hf_to_params` does and
returns the same dict, with QuantizedWeight values for the quantized paths.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from checkpoints import progress
from checkpoints.errors import CheckpointError
from checkpoints.name_table import check_names, hf_names, hf_to_params, table, to_ours
from jaxserve.config import ModelConfig
# What --quantize asked for is part of the load configuration (jaxserve/config_engine.py), which
# checks it when the flags are parsed; re-exported for this module's callers.
from jaxserve.config_engine import PER_CHANNEL, QuantizeSpec  # noqa: F401
from jaxserve.config_engine import QUANTIZE_GROUP_SIZES as GROUP_SIZES
from jaxserve.model.family import lead_dims, param_shapes
from jaxserve.model.quant_linear import QuantizedWeight

log = logging.getLogger("jaxserve.checkpoints")


# ---- one matrix ----------------------------------------------------------------------------

def quantize_int8(w: np.ndarray, group_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] float -> (q int8 [N, K], scale [N, K/G]): fp16 scales per group of G inputs,
    or fp32 scales per output row when group_size is None (per channel)."""
    N, K = w.shape
    G = K if group_size is None else group_size
    if K % G:
        raise CheckpointError(f"int8 group size {G} does not divide the input width {K}")
    wg = w.astype(np.float32).reshape(N, K // G, G)
    s = (np.abs(wg).max(axis=-1) / 127.0).astype(np.float16 if G < K else np.float32)  # [N, K/G]
    s = np.where(s > 0, s, 1).astype(s.dtype)  # an all-zero group (or one below fp16's range): q = 0
    q = np.clip(np.rint(wg / s.astype(np.float32)[..., None]), -127, 127).astype(np.int8).reshape(N, K)
    return q, s


def pack_int4(u: np.ndarray, group_size: int) -> np.ndarray:
    """u [..., N, K] in 0..15 -> packed uint8 [..., N, K/2] (group g's low nibbles hold its
    first G/2 inputs, high nibbles its last G/2)."""
    *lead, N, K = u.shape
    G = group_size
    ug = u.astype(np.uint8).reshape(*lead, N, K // G, 2, G // 2)
    return (ug[..., 0, :] | (ug[..., 1, :] << 4)).reshape(*lead, N, K // 2)


def unpack_int4(p: np.ndarray, group_size: int) -> np.ndarray:
    """The inverse of pack_int4: packed uint8 [..., N, K/2] -> u uint8 [..., N, K]."""
    *lead, N, Kh = p.shape
    G = group_size
    pg = p.reshape(*lead, N, Kh * 2 // G, G // 2)
    return np.concatenate([pg & 15, pg >> 4], axis=-1).reshape(*lead, N, Kh * 2)


def quantize_int4(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [N, K] float -> (packed uint8 [N, K/2], scale float16 [N, K/G], zero float16 [N, K/G])."""
    N, K = w.shape
    G = group_size
    if K % G:
        raise CheckpointError(f"int4 group size {G} does not divide the input width {K}")
    wg = w.astype(np.float32).reshape(N, K // G, G)
    lo, hi = wg.min(axis=-1), wg.max(axis=-1)
    s = ((hi - lo) / 15.0).astype(np.float16)
    s = np.where(s > 0, s, np.float16(1.0)).astype(np.float16)  # a constant group: u = 0
    z = lo.astype(np.float16)
    s32, z32 = s.astype(np.float32), z.astype(np.float32)
    u = np.clip(np.rint((wg - z32[..., None]) / s32[..., None]), 0, 15).astype(np.uint8)
    return pack_int4(u.reshape(N, K), G), s, z


def quantize_matrix(w: np.ndarray, bits: int, group_size: int | None) -> tuple:
    """(q, scale, zero) of w [N, K] (HF layout); zero is None for int8."""
    if bits == 8:
        return (*quantize_int8(w, group_size), None)
    return quantize_int4(w, group_size)


# ---- which parameters, and in which layout ---------------------------------------------------

def quantized_entries(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter path -> in_axes (axes of the per-matrix float shape that are inputs) for every
    parameter quantized by --quantize: the family table's "linear" rows (their leading `in_dims`
    dims are HF's input side; MoE experts too, one matrix per (layer, expert)); the tied
    embedding [V, D] has its input last."""
    out = {}
    for e in table(cfg):
        if e.layout == "linear" and e.quantize:
            out[e.path] = e.in_axes
    if cfg.tie_word_embeddings:
        out["embed"] = (1,)
    return out


def auto_group_size(cfg: ModelConfig) -> int:
    """The largest group size dividing every input width of the quantized matrices."""
    widths = {cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim}
    for g in GROUP_SIZES:
        if all(w % g == 0 for w in widths):
            return g
    raise CheckpointError(f"no group size in {sorted(GROUP_SIZES)} divides the model's input widths "
                          f"{sorted(widths)}; use --quantize int8 with per-channel scales")


def group_size_for(cfg: ModelConfig, quantize: QuantizeSpec) -> int | None:
    """The group size int8 / int4 round to: the one asked for, else int4's 32 and int8's
    auto_group_size; None = int8 per channel (quantize_int8's spelling of PER_CHANNEL)."""
    G = quantize.group_size
    if G is None:
        G = 32 if quantize.mode == "int4" else auto_group_size(cfg)
    return None if G == PER_CHANNEL else G


# get_quantized(hf_name) -> (bits, group_size, q, scale, zero) in the storage layout, or None
# when that tensor is stored in float (gguf_quant.py supplies it for GGUF files).
GetQuantized = Callable[[str], "tuple | None"]


def build_params(cfg: ModelConfig, names: set[str], get_float: Callable[[str], np.ndarray],
                 quantize: QuantizeSpec, get_quantized: GetQuantized | None = None) -> dict:
    """Parameters keyed by param_shapes paths, as hf_to_params returns them, with QuantizedWeight
    values for the quantized paths.

    get_float(hf_name): the HF-layout float tensor. int8 / int4 quantize it (round to nearest).
    get_quantized(hf_name): as-shipped only; the checkpoint's own quantized blocks, repacked.
    A path whose tensors are all shipped in float stays float under as-shipped.
    """
    if quantize.mode == "none":
        return hf_to_params(cfg, names, get_float)
    if quantize.mode == "as-shipped" and get_quantized is None:
        raise CheckpointError("--quantize as-shipped needs a quantized checkpoint (a GGUF file); this one "
                              "holds float weights: use --quantize int8 or int4")
    progress.describe(f"quantizing to {quantize.mode}" if quantize.mode != "as-shipped" else "repacking")
    expected = check_names(cfg, names)
    shapes = param_shapes(cfg)
    targets = quantized_entries(cfg)
    bits = {"int8": 8, "int4": 4}.get(quantize.mode)
    G = group_size_for(cfg, quantize) if bits else None
    params = {}
    for e in table(cfg):
        names_e = hf_names(e, cfg)
        n_lead = lead_dims(e)
        ours = shapes[e.path][n_lead:]
        qw = None
        if e.path in targets:
            if quantize.mode == "as-shipped":
                parts = [_rows(e, get_quantized(n)) for n in names_e]
            else:
                parts = []
                for n in names_e:
                    w = get_float(n)
                    _check_shape(n, w.shape, expected[n])
                    w = w if e.rows is None else w[e.rows[0]:e.rows[0] + e.rows[1]]
                    parts.append((bits, G or w.shape[1], *quantize_matrix(w, bits, G)))
            qw = _join(e, names_e, parts, expected, ours, targets[e.path], shapes[e.path][:n_lead])
        if qw is not None:
            params[e.path] = qw
            continue
        arrays = []
        for n in names_e:
            w = get_float(n)
            _check_shape(n, w.shape, expected[n])
            arrays.append(to_ours(e, w, ours))
        params[e.path] = np.stack(arrays).reshape(shapes[e.path]) if n_lead else arrays[0]
    return params


def _rows(e, part):
    """A fused tensor's quantized part -> this row's rows (whole output rows move, exactly)."""
    if part is None or e.rows is None:
        return part
    lo, hi = e.rows[0], e.rows[0] + e.rows[1]
    bits, G, q, s, z = part
    return bits, G, q[lo:hi], s[lo:hi], None if z is None else z[lo:hi]


def _check_shape(name: str, got, want) -> None:
    if tuple(got) != tuple(want):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(got)}, expected {tuple(want)}")


def _join(e, hf_names_e, parts, expected, ours, in_axes, lead) -> QuantizedWeight | None:
    """Per-tensor quantized parts -> one QuantizedWeight (stacked to `lead`: [L] or, for MoE
    experts, [L, E]); None if every part is float."""
    path, stacked = e.path, e.per_layer
    if all(p is None for p in parts):
        return None
    kinds = {None if p is None else p[:2] for p in parts}
    if len(kinds) != 1:
        if None not in kinds and {k[0] for k in kinds} == {8}:
            parts = _common_int8_groups(parts)  # e.g. Q8_0 (g32) and Q6_K (g16) layers: exact
        else:
            # A stack needs one layout, and no layout holds e.g. Q4_K (int4 with a zero) and
            # Q6_K (6 bits) layers both exactly; their float values are gguf's exact dequantize.
            fmt = lambda k: "float" if k is None else f"int{k[0]}/g{k[1]}"  # noqa: E731
            log.warning("%s: its tensors (%s ...) come in formats %s that no one stacked layout holds "
                        "exactly; loaded as float (their exact dequantized values)", path, hf_names_e[0],
                        sorted(map(fmt, kinds), key=str))
            return None
    if len({p[3].dtype for p in parts}) > 1:  # fp16 (Q8_0) and fp32 (K-quant) scales: fp32, exact
        parts = [(b, g, q, s.astype(np.float32), None if z is None else z.astype(np.float32))
                 for b, g, q, s, z in parts]
    bits, G = parts[0][:2]
    for n, p in zip(hf_names_e, parts):
        N, K = expected[n]
        N = N if e.rows is None else e.rows[1]
        want = (N, K // 2 if bits == 4 else K)
        if tuple(p[2].shape) != want or tuple(p[3].shape) != (N, K // G):
            raise CheckpointError(f"tensor {n!r}: quantized data {p[2].shape} / scales {p[3].shape}, "
                                  f"expected {want} / {(N, K // G)}")

    def join(i):
        if parts[0][i] is None:
            return None
        if not stacked:
            return parts[0][i]
        a = np.stack([p[i] for p in parts])
        return a.reshape(tuple(lead) + a.shape[1:])
    return QuantizedWeight(q=join(2), scale=join(3), zero=join(4), bits=bits, group_size=G,
                           shape=tuple(ours), in_axes=tuple(in_axes))


def _common_int8_groups(parts: list) -> list:
    """int8 parts of different group sizes -> all at the smallest (each scale repeated over the
    smaller groups it covers: the same weights exactly). GGUF's group sizes (16, 32) and per
    channel (G = K) are each a multiple of the smallest."""
    G = min(p[1] for p in parts)
    if any(p[1] % G for p in parts):
        raise CheckpointError(f"int8 group sizes {sorted({p[1] for p in parts})} have no common refinement")
    return [(8, G, q, np.repeat(s, g // G, axis=-1), None) for _, g, q, s, _ in parts]


def quantize_params(cfg: ModelConfig, params: dict, quantize: QuantizeSpec) -> dict:
    """int8 / int4 of float parameters already in the model layout (param_shapes paths, e.g.
    from llama.flat_params): the same weights and rounding as build_params, each matrix taken
    to the storage layout [out, in] first. For tests and for models built in memory."""
    if quantize.mode not in ("int8", "int4"):
        raise CheckpointError(f"quantize_params: --quantize {quantize.mode} needs a checkpoint; "
                              f"in-memory weights take int8 or int4")
    bits = 8 if quantize.mode == "int8" else 4
    G = group_size_for(cfg, quantize)
    out = dict(params)
    leads = {e.path: lead_dims(e) for e in table(cfg)}
    for path, in_axes in quantized_entries(cfg).items():
        w = np.asarray(params[path], np.float32)
        lead = leads[path]  # stacked dims: 0, 1 (layers) or 2 (layers, experts)
        shape = w.shape[lead:]
        out_axes = tuple(a for a in range(len(shape)) if a not in in_axes)
        N = int(np.prod([shape[a] for a in out_axes]))
        perm = tuple(range(lead)) + tuple(lead + a for a in out_axes + in_axes)
        nk = w.transpose(perm).reshape(w.shape[:lead] + (N, -1))
        mats = [quantize_matrix(m, bits, G) for m in (nk.reshape((-1,) + nk.shape[lead:]) if lead else nk[None])]
        stack = lambda i: None if mats[0][i] is None else np.stack(  # noqa: E731
            [m[i] for m in mats]).reshape(w.shape[:lead] + mats[0][i].shape)
        q, s, z = (stack(i) if lead else (None if mats[0][i] is None else mats[0][i]) for i in range(3))
        out[path] = QuantizedWeight(q=q, scale=s, zero=z, bits=bits, group_size=G or nk.shape[-1],
                                    shape=tuple(shape), in_axes=in_axes)
    return out


def dequantize_params(params: dict) -> dict[str, np.ndarray]:
    """Every QuantizedWeight replaced by its fp32 weights in the model layout (exactly what the
    quantized matmul computes with), so a float Llama can be built from quantized params."""
    return {k: (np.asarray(v.dequantize()) if isinstance(v, QuantizedWeight) else v) for k, v in params.items()}


def describe(params: dict) -> str:
    """One line: how many bytes the parameters take and in which formats."""
    kinds: dict[str, int] = {}
    total = 0
    for v in params.values():
        if isinstance(v, QuantizedWeight):
            kind = f"int{v.bits}" + (f"/g{v.group_size}" if v.group_size != v.in_features else "/channel")
            nbytes = sum(a.nbytes for a in (v.q, v.scale, v.zero) if a is not None)
        else:
            kind, nbytes = str(v.dtype), v.nbytes
        kinds[kind] = kinds.get(kind, 0) + nbytes
        total += nbytes
    parts = ", ".join(f"{k} {n / 1e6:.1f} MB" for k, n in sorted(kinds.items()))
    return f"{total / 1e6:.1f} MB of weights ({parts})"


def load_quantized_params(path, quantize: QuantizeSpec):
    """checkpoints.load_params with --quantize applied: a LoadedParams whose params hold
    QuantizedWeight values for the quantized paths. HF folders: int8 / int4 from their float
    weights. GGUF: as-shipped repacks Q8_0 / Q4_0 / Q4_1 blocks (gguf_quant.py); int8 / int4
    requantize the dequantized floats (a float round trip, asked for explicitly)."""
    import checkpoints
    from checkpoints.hf import open_safetensors, read_hf_config
    p = checkpoints.resolve_model_path(path)
    if quantize.mode == "none":
        return checkpoints.load_params(p)
    if p.is_dir():
        cfg = read_hf_config(p)
        with open_safetensors(p) as (names, get):
            params = build_params(cfg, names, get, quantize)
        return checkpoints.LoadedParams(cfg, params, p, "hf")
    if p.suffix == ".gguf":
        from checkpoints.gguf_loader import GGUFCheckpoint
        from checkpoints.gguf_quant import quantized_getter
        ckpt = GGUFCheckpoint(p)
        getq = quantized_getter(ckpt) if quantize.mode == "as-shipped" else None
        params = build_params(ckpt.config, set(ckpt._hf_to_gguf), ckpt.hf_tensor, quantize, getq)
        return checkpoints.LoadedParams(ckpt.config, params, p, "gguf", ckpt.metadata)
    raise CheckpointError(f"model path {p}: not a folder or a .gguf file")
