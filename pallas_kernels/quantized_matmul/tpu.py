"""Weight-quantized matmul for TPU (Pallas Mosaic): x [M, K] times int8 or packed-int4 weights
[N, K'] with group scales, dequantized inside the kernel, fp32 accumulation.

Layouts are reference.py's. Grid: (M / bm, N / bn, K / bk), the K axis last and "arbitrary"
(the fp32 accumulator [bm, bn] lives in VMEM scratch across it), the others "parallel".
Per grid step the pipeline DMAs an x block [bm, bk] and a weight block [bn, bk] (int8) or
[bn, bk/2] (packed int4); the scales of the output block, all its groups [bn, K/G] (and the
zeros), come once per output column block and stay resident while k advances (their block
index does not change), so a weight byte is read from HBM once per M block.

Inside a step, for each group g of the block (static unroll, bk / G of them):
  the group's scale column s_g [bn, 1] is picked out of the resident [bn, K/G] block by a
  masked lane sum (exact; no dynamic lane slicing, which Mosaic handles poorly), then
  int8: w_g = q_g [bn, G] * s_g                       -> acc += x_g [bm, G] . w_g^T
  int4: lo_g, hi_g = the group's low / high nibbles [bn, G/2] (its two contiguous halves
        of inputs, so no interleave), each * s_g + z_g -> acc += x_lo . lo^T + x_hi . hi^T
with the dequantized weights cast to x's dtype and the dots (MXU, NT) accumulating in fp32.
Per channel int8 (G = K) has one scale column for every block.

Shapes need not be multiples of the blocks in M and N: the last blocks read padding and their
extra rows / columns are dropped on write. K blocks must tile K exactly (a partial K block
would add padding into valid outputs), so bk is chosen among K's divisors (block_sizes.py).

Not verified on TPU hardware (none was at hand): tests run it under the TPU interpret mode on
CPU and lower it to Mosaic MLIR (lowering_platforms=("tpu",)); Mosaic's own layout passes (in
libtpu) were not exercised. float16 scales need a TPU generation with f16 vector loads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import interpret as interpret_mode
from pallas_kernels.quantized_matmul import block_sizes
from pallas_kernels.quantized_matmul.reference import ref_quantized_matmul  # noqa: F401  (the ref_ twin)
from pallas_kernels.quantized_matmul.reference import validate

_LANES = 128
_NT = (((1,), (1,)), ((), ()))  # contract the last dim of both operands: x [m, k] . w [n, k]^T


def _sublanes(dtype) -> int:
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def choose_blocks(M: int, N: int, K: int, *, bits: int, group_size: int, x_dtype,
                  bm: int | None = None, bn: int | None = None, bk: int | None = None
                  ) -> tuple[int, int, int]:
    """(bm, bn, bk) from block_sizes.TPU_TABLE (or the given overrides), made legal."""
    row = block_sizes.lookup(block_sizes.TPU_TABLE, m=M, bits=bits)
    sub = _sublanes(x_dtype)
    bm = min(bm or row["bm"], _round_up(M, sub))
    bn = bn or row["bn"]
    bn = N if N <= bn else bn
    G = group_size
    if bk is None:
        per_lane = 2 if bits == 4 else 1
        unit = G if G < K else _LANES  # per channel: any whole-lane divisor of K
        cands = [c for c in range(unit, min(row["bk"], K) + 1, unit)
                 if K % c == 0 and (c // per_lane) % _LANES == 0]
        bk = max(cands) if cands else K
    return bm, bn, bk


def _check_blocks(M, N, K, bm, bn, bk, *, bits, group_size, x_dtype) -> None:
    G = group_size
    if K % bk:
        raise ValueError(f"TPU quantized matmul: bk={bk} must divide K={K}")
    if G != K and bk % G:
        raise ValueError(f"TPU quantized matmul: bk={bk} must be a multiple of the group size {G}")
    lanes = bk // 2 if bits == 4 else bk
    if bk != K and (lanes % _LANES or bk % _LANES):
        raise ValueError(f"TPU quantized matmul: bk={bk} gives a weight block of {lanes} lanes; "
                         f"blocks must be whole {_LANES}-lane rows or all of K={K}")
    if bn != N and bn % _LANES:
        raise ValueError(f"TPU quantized matmul: bn={bn} must be a multiple of {_LANES} or N={N}")
    if bm % _sublanes(x_dtype) and bm != M:
        raise ValueError(f"TPU quantized matmul: bm={bm} must be a multiple of {_sublanes(x_dtype)} "
                         f"for {jnp.dtype(x_dtype).name} x [M={M}, K]")


def _kernel(x_ref, q_ref, s_ref, *rest, bits: int, group_size: int, bk: int, per_channel: bool):
    if bits == 4:
        z_ref, o_ref, acc_ref = rest
    else:
        z_ref, (o_ref, acc_ref) = None, rest
    k = pl.program_id(2)
    G = group_size

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[...]
    cdt = x.dtype
    if per_channel:  # int8, G = K: the one scale column serves every block
        w = q_ref[...].astype(jnp.float32) * s_ref[...].astype(jnp.float32)  # [bn, bk]
        acc_ref[...] += jax.lax.dot_general(x, w.astype(cdt), _NT, preferred_element_type=jnp.float32)
    else:
        gpb = bk // G  # groups in this block
        s_all = s_ref[...].astype(jnp.float32)  # [bn, K/G], resident
        z_all = z_ref[...].astype(jnp.float32) if bits == 4 else None
        col = jax.lax.broadcasted_iota(jnp.int32, s_all.shape, 1)

        def column(a, g):  # a[:, k * gpb + g] as [bn, 1], exactly (one nonzero term)
            return jnp.sum(jnp.where(col == k * gpb + g, a, 0.0), axis=1, keepdims=True)

        w = q_ref[...]
        if bits == 4:
            w = w.astype(jnp.int32)
            lo = (w & 15).astype(jnp.float32)  # [bn, bk/2]
            hi = jax.lax.shift_right_logical(w, 4).astype(jnp.float32)
        else:
            w = w.astype(jnp.float32)  # [bn, bk]
        total = None
        for g in range(gpb):
            s_g = column(s_all, g)
            xg = x[:, g * G:(g + 1) * G]
            if bits == 8:
                wg = (w[:, g * G:(g + 1) * G] * s_g).astype(cdt)
                part = jax.lax.dot_general(xg, wg, _NT, preferred_element_type=jnp.float32)
            else:
                h = G // 2
                z_g = column(z_all, g)
                lo_g = (lo[:, g * h:(g + 1) * h] * s_g + z_g).astype(cdt)
                hi_g = (hi[:, g * h:(g + 1) * h] * s_g + z_g).astype(cdt)
                part = (jax.lax.dot_general(xg[:, :h], lo_g, _NT, preferred_element_type=jnp.float32)
                        + jax.lax.dot_general(xg[:, h:], hi_g, _NT, preferred_element_type=jnp.float32))
            total = part if total is None else total + part
        acc_ref[...] += total

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "out_dtype", "interpret",
                                             "bm", "bn", "bk"))
def quantized_matmul_tpu(x, q, scale, zero=None, *, bits: int, group_size: int, out_dtype=None,
                         interpret: bool | str = False, bm: int | None = None, bn: int | None = None,
                         bk: int | None = None):
    """y = x @ dequantize(q, scale, zero)^T on TPU.

    Operands and result as reference.ref_quantized_matmul (layouts in its module docstring):
    x [M, K] activations, q / scale / zero the stored weight, [M, N] out; fp32 accumulation.
    bm, bn, bk override block_sizes.TPU_TABLE (tests). interpret: False (compile for TPU),
    "tpu" / "tpu_nan" / "tpu_zero" (the TPU interpret mode: TPU semantics simulated on CPU,
    slow; uninitialised memory NaN or zero) or True / "nan" / "zero" (Pallas's generic
    interpret mode: the kernel body as plain XLA, fast enough for sweeps); see
    pallas_kernels/interpret.py.
    """
    validate(x, q, scale, zero, bits=bits, group_size=group_size)
    M, K = x.shape
    N = q.shape[0]
    bm, bn, bk = choose_blocks(M, N, K, bits=bits, group_size=group_size, x_dtype=x.dtype,
                               bm=bm, bn=bn, bk=bk)
    _check_blocks(M, N, K, bm, bn, bk, bits=bits, group_size=group_size, x_dtype=x.dtype)
    per_channel = bits == 8 and group_size == K
    wk = bk // 2 if bits == 4 else bk
    in_specs = [
        pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)),
        pl.BlockSpec((bn, wk), lambda i, j, k: (j, k)),
        pl.BlockSpec((bn, K // group_size), lambda i, j, k: (j, 0)),
    ]
    args = [x, q, scale]
    if bits == 4:
        in_specs.append(pl.BlockSpec((bn, K // group_size), lambda i, j, k: (j, 0)))
        args.append(zero)
    kernel = functools.partial(_kernel, bits=bits, group_size=group_size, bk=bk,
                               per_channel=per_channel)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), out_dtype or x.dtype),
        grid=(pl.cdiv(M, bm), pl.cdiv(N, bn), K // bk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=(interpret_mode.tpu_params(interpret[4:] or True)
                   if isinstance(interpret, str) and interpret.startswith("tpu")
                   else interpret_mode.generic_param(interpret)),
        name=f"quantized_matmul_int{bits}",
    )(*args)
