"""Weight-quantized matmul for TPU (Pallas Mosaic): x [M, K] times int8 or packed-int4 weights
[N, K'] with group scales, dequantized inside the kernel, fp32 accumulation.

Layouts are reference.py's. Grid: (M / bm, N / bn, K / bk), the K axis last and "arbitrary"
(the fp32 accumulator [bm, bn] lives in VMEM scratch across it), the others "parallel".
Per grid step the pipeline DMAs an x block [bm, bk] and a weight block [bn, bk] (int8) or
[bn, bk/2] (packed int4); the scales (and zeros) of the output block come once per output
column block as f32 rows [K/G, bn] (the wrapper transposes and converts [N, K/G] f16 / bf16 /
f32 scales: v5e and v6e have no f16 vector loads) and stay resident while k advances.

Decode (M <= 64) takes all of K per block (bk = K: one grid step per output block) and bn as
wide as a 4 MiB weight block allows (block_sizes.TPU_TABLE, choose_blocks): 4096 -> 14336 int8
is 14 steps of [1024, 4096], 14336 -> 4096 16 steps of [256, 14336], where (16, 512, 1024)
blocks made 112 steps of ~0.35 us fixed cost each. Prefill keeps square-ish blocks.

Scales apply to the [bm, bn] product, not to the [bn, G] weights: int8 codes and int4
nibbles are exact in bf16, so each group is convert -> dot (MXU, fp32) -> x scale row:
  int8 per channel: acc += x_c . q_c^T over 512-input chunks; out = acc * s (once, at the end)
  int8 grouped:     acc += (x_g . q_g^T) * s_g
  int4:             acc += (x_lo . lo^T + x_hi . hi^T) * s_g + sum(x_g) * z_g
                    (W = u s + z, so x . W^T = s (x . u^T) + z sum(x); lo / hi are the group's
                    low / high nibbles, its two contiguous input halves)
which is bm x bn VPU multiplies per group instead of bn x G (8x fewer at bm = 16, G = 128),
and no f32 copy of a weight block. Groups go in chunks of whole 128-lane weight columns (two
int4 groups of 128: 64 packed bytes each), up to 4 chunks unrolled and more (bk = K) as a loop
over aligned chunks (sum_group_products: a loop over single 64-lane groups was Mosaic's E2003).

Shapes need not be multiples of the blocks in M and N: the last blocks read padding and their
extra rows / columns are dropped on write. K blocks must tile K exactly (a partial K block
would add padding into valid outputs), so bk is chosen among K's divisors (block_sizes.py).

Not run on TPU hardware (none was at hand): tests run it under the TPU interpret mode on CPU;
scripts/tpu_kernel_sweep.py compiles it with libtpu (Mosaic + XLA:TPU, compile-only devices)
for v5e / v6e / v5p at every projection of Llama-3.1-8B / 70B (tp 1, 8), Qwen3-30B-A3B and
Gemma-3-27B, M = 1 / 16 / 256; VMEM is asked for explicitly (vmem_limit_bytes, from the blocks).
"""

from __future__ import annotations

import functools
import math

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
_UNROLL_CHUNKS = 4  # 128-lane chunks of groups per block unrolled; more run as a fori_loop
_WEIGHT_BLOCK_BYTES = 4 << 20  # decode: the widest bn whose [bn, K] weight block fits this


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
    G = group_size
    if row["bk"] == "K" and bk is None:
        # Decode: all of K per block (one grid step per output block, no K loop) and bn as wide
        # as a _WEIGHT_BLOCK_BYTES weight block allows (double-buffered by the pipeline):
        # 4096 -> 14336 int8 runs 14 steps of [1024, 4096], 14336 -> 4096 16 of [256, 14336].
        bk = K
        if bn is None:
            row_bytes = K // 2 if bits == 4 else K
            bn = max(_LANES, min(row["bn"], _WEIGHT_BLOCK_BYTES // row_bytes // _LANES * _LANES))
    bn = bn or row["bn"]
    bn = N if N <= bn else bn
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


def dot_nt(a, b):
    """a [m, k] . b [n, k]^T -> [m, n] fp32 (the weights' stored [out, in] layout)."""
    return jax.lax.dot_general(a, b, _NT, preferred_element_type=jnp.float32)


def sum_group_products(x_ref, q_ref, s_ref, z_ref, first_row, groups: int, *, bits: int,
                       group_size: int, shape) -> jax.Array:
    """The [m, n] fp32 product of a block of x with its weight block's `groups` quantization groups
    (x's columns and q's in order, group g's scale and zero at row first_row + g of s_ref / z_ref,
    [1, n] rows applied to the [m, n] product, not to the [n, G] weights). Shared by this kernel
    and the grouped (MoE) one, pallas_kernels/grouped_matmul/tpu_quantized.py.

    The groups go in chunks of whole 128-lane weight columns (`_chunk_groups`: 2 groups of int4
    G = 128, 8 of G = 32; 4 of int8 G = 32), each chunk's x and q loaded from the refs as one
    aligned slab and its groups sliced out of those values. Mosaic must prove that a dynamic
    lane offset is a multiple of 128 (E2003 otherwise), so a loop over single groups (a
    G / 2 = 64-lane step of packed int4) does not compile, while a loop over aligned chunks does.
    Up to _UNROLL_CHUNKS chunks unroll; more (bk = K with small groups) run as a fori_loop, which
    also keeps compile time flat in K (int4 decode at K = 4096, 32 unrolled groups, took 10 s)."""
    G, cdt = group_size, x_ref.dtype
    wl = G // 2 if bits == 4 else G  # weight lanes per group
    per = _chunk_groups(bits, G, groups)

    def group(xv, qv, row):
        """Group at row `row` of the scales: xv [m, G] inputs, qv [n, wl] its stored weights."""
        s_g = s_ref[pl.ds(row, 1), :]
        if bits == 8:
            return dot_nt(xv, qv.astype(cdt)) * s_g
        # W = u * s + z, so x . W^T = s * (x . u^T) + z * sum(x): the nibbles (0..15, exact
        # in bf16) go to the MXU as they are.
        h = G // 2
        lo = (qv & 15).astype(cdt)
        hi = jax.lax.shift_right_logical(qv, 4).astype(cdt)
        x_lo, x_hi = xv[:, :h], xv[:, h:]
        xsum = jnp.sum(xv.astype(jnp.float32), axis=1, keepdims=True)  # [m, 1]
        return (dot_nt(x_lo, lo) + dot_nt(x_hi, hi)) * s_g + xsum * z_ref[pl.ds(row, 1), :]

    def chunk(c, total):
        xc = x_ref[:, _lanes(c * (per * G), per * G, per * G)]  # [m, per * G]
        qc = q_ref[:, _lanes(c * (per * wl), per * wl, per * wl)]  # [n, per * wl], whole lanes
        if bits == 4:
            qc = qc.astype(jnp.int32)
        for i in range(per):
            total = total + group(xc[:, i * G:(i + 1) * G], qc[:, i * wl:(i + 1) * wl],
                                  first_row + c * per + i)
        return total

    zero = jnp.zeros(shape, jnp.float32)
    chunks = groups // per
    if chunks <= _UNROLL_CHUNKS:
        total = zero
        for c in range(chunks):
            total = chunk(c, total)
        return total
    return jax.lax.fori_loop(0, chunks, chunk, zero)


def _chunk_groups(bits: int, group_size: int, groups: int) -> int:
    """Groups per chunk of sum_group_products: as many as make a whole number of 128-lane weight
    columns (1 when a group is that already), or all `groups` when they do not tile so (a block
    narrower than 128 lanes, all of a small K: static offsets only, which Mosaic takes)."""
    wl = group_size // 2 if bits == 4 else group_size
    per = 1 if wl % _LANES == 0 else _LANES // math.gcd(wl, _LANES)
    return per if groups % per == 0 else groups


def _kernel(x_ref, q_ref, s_ref, *rest, bits: int, group_size: int, bk: int, per_channel: bool):
    """One [bm, bn] output block's share of K (see the module docstring for the arithmetic)."""
    if bits == 4:
        z_ref, o_ref, acc_ref = rest
    else:
        z_ref, (o_ref, acc_ref) = None, rest
    k = pl.program_id(2)
    cdt = x_ref.dtype

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    if per_channel:
        # int8 codes are exact in bf16 (|q| <= 127): convert, dot, and scale the accumulator
        # once at the end, [bm, bn] multiplies instead of [bn, K]. The block goes through in
        # chunks so the converted copy stays small when bk = K.
        chunk = _chunk(bk)
        total = None
        for c in range(bk // chunk):
            cols = slice(c * chunk, (c + 1) * chunk)
            part = dot_nt(x_ref[:, cols], q_ref[:, cols].astype(cdt))
            total = part if total is None else total + part
        acc_ref[...] += total

        @pl.when(k == pl.num_programs(2) - 1)
        def _():
            o_ref[...] = (acc_ref[...] * s_ref[...]).astype(o_ref.dtype)  # s [1, bn] lanes
        return

    gpb = bk // group_size  # groups in this block
    acc_ref[...] += sum_group_products(x_ref, q_ref, s_ref, z_ref, k * gpb, gpb, bits=bits,
                                       group_size=group_size, shape=acc_ref.shape)

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _lanes(start, size: int, align: int):
    """Lanes [start, start + size): a static slice, or an aligned dynamic one inside a loop."""
    if isinstance(start, int):
        return slice(start, start + size)
    return pl.ds(pl.multiple_of(start, align), size)


def _chunk(bk: int) -> int:
    """Inputs per converted chunk of a per-channel block: the largest of 512, 256, 128 dividing bk."""
    for c in (512, 256, 128):
        if bk % c == 0:
            return c
    return bk


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
    # Scales (and zeros) go in as f32 rows [K/G, N]: a group's scales are one lane row [1, bn]
    # that multiplies the [bm, bn] product, and no f16 reaches the kernel (v5e / v6e have no
    # f16 vector loads; GGUF scales are f16). A transpose + convert of N x K/G values per call,
    # ~3% of the weight bytes at G = 128 and 2-byte scales (better done once at load).
    rows = K // group_size
    sT = scale.astype(jnp.float32).T
    in_specs = [
        pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)),
        pl.BlockSpec((bn, wk), lambda i, j, k: (j, k)),
        pl.BlockSpec((rows, bn), lambda i, j, k: (0, j)),  # resident while k advances
    ]
    args = [x, q, sT]
    if bits == 4:
        in_specs.append(pl.BlockSpec((rows, bn), lambda i, j, k: (0, j)))
        args.append(zero.astype(jnp.float32).T)
    xb, ob = x.dtype.itemsize, jnp.dtype(out_dtype or x.dtype).itemsize
    need = (2 * (bm * bk * xb + bn * wk * q.dtype.itemsize + (2 if bits == 4 else 1) * _round_up(rows, 8) * bn * 4)
            + 2 * bm * bn * ob + bm * bn * 4 + 3 * bn * min(bk, 512) * 4)  # + converted chunk, products
    vmem_limit = min(max(_round_up(need * 5 // 4, 1 << 20), 16 << 20), 48 << 20)
    kernel = functools.partial(_kernel, bits=bits, group_size=group_size, bk=bk,
                               per_channel=per_channel)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), out_dtype or x.dtype),
        grid=(pl.cdiv(M, bm), pl.cdiv(N, bn), K // bk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit),
        interpret=(interpret_mode.tpu_params(interpret[4:] or True)
                   if isinstance(interpret, str) and interpret.startswith("tpu")
                   else interpret_mode.generic_param(interpret)),
        name=f"quantized_matmul_int{bits}",
    )(*args)
