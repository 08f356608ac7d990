"""Quantized linear layers: the `QuantizedWeight` pytree and the one `einsum` every projection
calls, whether its weight is a float array or a QuantizedWeight.

A projection in the model is an einsum such as "btd,dnh->btnh" (q) or "btnh,nhd->btd" (o).
`einsum(spec, x, w)` runs exactly jnp.einsum for a float `w`. For a QuantizedWeight it reads
from the spec which letters are contracted and which are outputs, lays x out as [M, K] (the
spec's batch letters, then the contracted ones in the weight's order), calls the model's
resolved quantized matmul once (`matmul`: a sharding.quantized_matmul.QuantizedMatmul, chosen at
load from quant_impl and held by the Decoder, as `attend` is passed in for attention), and lays
the [M, N] result out as the spec's output. So the
model code does not branch per layer or per format, and the float layout of a weight (which
the model owns) and its quantized storage (out-major, K grouped; below) are independent. A
QuantizedWeight carries its layout only (bits, group size, shapes, how it is split over "tp"),
never which implementation runs it or on which mesh.

Stacked weights ([L, ...] under lax.scan) work unchanged: the arrays carry the leading layer
axis and scan slices it off; the static fields describe one matrix.

Tied embeddings: the table [V, D] quantized with in_axes=(1,) is at once the LM head
("btd,vd->btv") and the embedding (`embedding_lookup` gathers and dequantizes rows).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp



@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """One weight matrix (or a stack of them) stored quantized along its input axis K in groups
    of `group_size` inputs. N = prod of the output dims of `shape`, K = prod of its input dims.
    `...` below is the stacked leading dims ([L] for per-layer weights, none otherwise)."""

    q: jax.Array  # bits=8: int8 [..., N, K]; bits=4: uint8 [..., N, K/2], two inputs a byte
    #               (group g's bytes are [g*G/2, (g+1)*G/2): low nibble input g*G + j, high
    #               nibble input g*G + G/2 + j; GGUF Q4_0/Q4_1's order for G = 32)
    scale: jax.Array  # [..., N, K/G] float16 / bfloat16 / float32; W = scale * q (+ zero)
    zero: jax.Array | None  # bits=4: [..., N, K/G], scale's dtype, W = scale * u + zero, u in
    #                         0..15 (GGUF's min); bits=8: None (symmetric)
    bits: int = dataclasses.field(metadata=dict(static=True))  # 8 or 4
    group_size: int = dataclasses.field(metadata=dict(static=True))  # G; G == K is per channel
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # one matrix's float
    #                         shape in the model's layout, e.g. wq (D, N, H), wo (N, H, D)
    in_axes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # axes of `shape`
    #                         contracted by the projection, e.g. (0,) for wq, (0, 1) for wo
    split: str | None = dataclasses.field(default=None, metadata=dict(static=True))  # "n" | "k"
    #                         when the arrays are split over the mesh's "tp" axis by output rows
    #                         or by input groups (sharding/rules.quantized_spec); the matmul then
    #                         runs per shard. None: one device, or replicated

    def __post_init__(self):
        if self.bits not in (8, 4):
            raise ValueError(f"QuantizedWeight: bits must be 8 or 4, got {self.bits}")
        if any(not 0 <= a < len(self.shape) for a in self.in_axes) or len(set(self.in_axes)) != len(self.in_axes):
            raise ValueError(f"QuantizedWeight: in_axes {self.in_axes} invalid for shape {self.shape}")
        if not all(hasattr(a, "shape") for a in (self.q, self.scale)):
            return  # leaves replaced by placeholders (jax.tree.map to axis specs, etc.)
        K, N, G = self.in_features, self.out_features, self.group_size
        kq = K // 2 if self.bits == 4 else K
        if tuple(self.q.shape[-2:]) != (N, kq):
            raise ValueError(f"QuantizedWeight int{self.bits} of shape {self.shape} (in_axes {self.in_axes}): "
                             f"q must end in [N, K{'/2' if self.bits == 4 else ''}] = [{N}, {kq}], got {self.q.shape}")
        if K % G or tuple(self.scale.shape[-2:]) != (N, K // G):
            raise ValueError(f"QuantizedWeight of shape {self.shape}: scale must end in [N, K/G] = "
                             f"[{N}, {K // G if G and K % G == 0 else '?'}] (K={K}, G={G}), got {self.scale.shape}")
        if self.split not in (None, "n", "k"):
            raise ValueError(f"QuantizedWeight: split must be None, 'n' or 'k', got {self.split!r}")
        if (self.zero is None) != (self.bits == 8):
            raise ValueError(f"QuantizedWeight: zero is {'required' if self.bits == 4 else 'not allowed'} "
                             f"for int{self.bits}")

    def __getitem__(self, key):
        # `variable[...]` is how the model reads a parameter (nnx.Variable indexes its value);
        # x[...] is x, as for arrays. Any other index is a mistake: index the arrays instead.
        if key is Ellipsis:
            return self
        raise TypeError(f"QuantizedWeight supports only [...] indexing, got {key!r}")

    @property
    def in_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[a] for a in self.in_axes)

    @property
    def out_axes(self) -> tuple[int, ...]:
        return tuple(a for a in range(len(self.shape)) if a not in self.in_axes)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[a] for a in self.out_axes)

    @property
    def in_features(self) -> int:
        return math.prod(self.in_shape)

    @property
    def out_features(self) -> int:
        return math.prod(self.out_shape)

    @property
    def lead_shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape[:-2])

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The float weight's whole shape, stacked dims included (what param_shapes lists)."""
        return self.lead_shape + tuple(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.q, self.scale, self.zero) if a is not None)

    def placed(self, sharding, split: str | None) -> "QuantizedWeight":
        """q, scale and zero put on devices with `sharding` (one NamedSharding fits all three:
        they share the layout [..., N, .]); `split` ("n", "k" or None) as rules.quantized_spec
        chose it, recorded so the matmul runs per shard (on the mesh its QuantizedMatmul holds)."""
        def put(a):  # an abstract weight (jaxserve/aot) gets the sharding and stays abstract
            if a is None:
                return None
            if isinstance(a, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
            return jax.device_put(a, sharding)
        return dataclasses.replace(self, q=put(self.q), scale=put(self.scale), zero=put(self.zero), split=split)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float weight in the model's layout, full_shape (tests, debugging, conversion)."""
        nk = _dequantize_nk(self)  # [..., N, K]
        lead = self.lead_shape
        w = nk.reshape(lead + self.out_shape + self.in_shape)
        order = self.out_axes + self.in_axes  # axis i of w is axis order[i] of `shape`
        perm = tuple(range(len(lead))) + tuple(len(lead) + order.index(a) for a in range(len(self.shape)))
        return jnp.transpose(w, perm).astype(dtype)


def _dequantize_nk(w: QuantizedWeight) -> jax.Array:
    """[..., N, K] fp32. The same arithmetic as pallas_kernels.quantized_matmul.reference's
    `dequantize`, repeated here because the model package does not import kernels (an
    import-linter contract); tests check the two agree bit for bit."""
    G = w.group_size
    q = w.q
    if w.bits == 8:
        u = q.astype(jnp.float32)
    else:
        p = q.reshape(*q.shape[:-1], q.shape[-1] * 2 // G, G // 2).astype(jnp.int32)
        u = jnp.concatenate([p & 15, p >> 4], axis=-1).astype(jnp.float32)
        u = u.reshape(*q.shape[:-1], q.shape[-1] * 2)
    *lead, N, K = u.shape
    d = u.reshape(*lead, N, K // G, G) * w.scale.astype(jnp.float32)[..., None]
    if w.bits == 4:
        d = d + w.zero.astype(jnp.float32)[..., None]
    return d.reshape(*lead, N, K)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedFloatWeight:
    """A float weight [K.., N..] (contraction dims first) packed at load for the native small-M
    kernel (pallas_kernels/small_matmul/cpu_native.pack): data [..., ceil(N/64), K, 64]. `layer`:
    a traced index into a stacked data's first dim (the decoder passes the whole stack and the
    layer, so no per-layer slice is copied), or None. A product the kernel does not take (not
    fp32, or a matmul_impl other than the packed row) runs jnp.einsum on an unpacked copy
    (matrix()). `transposed`: the parameter this stands for is the matrix's transpose (a
    tied embedding [V, D], packed as the LM head's [D, V]; embedding_lookup reads its rows
    from the packed tiles)."""

    data: jax.Array
    layer: jax.Array | None
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # the matrix's [K.., N..] shape
    n_in: int = dataclasses.field(metadata=dict(static=True))  # how many leading dims of shape are K
    transposed: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def dtype(self):
        return self.data.dtype

    def __getitem__(self, key):
        if key is Ellipsis:  # `variable[...]`, how the model reads a parameter
            return self
        raise TypeError(f"PackedFloatWeight: index the packed array (.data), not {key!r}")

    def matrix(self) -> jax.Array:
        """The [K.., N..] matrix (one layer's where `layer` is set), a copy."""
        d = self.data if self.layer is None else jax.lax.dynamic_index_in_dim(self.data, self.layer, 0, False)
        k = math.prod(self.shape[:self.n_in])
        n = math.prod(self.shape[self.n_in:])
        w = jnp.moveaxis(d, -3, -2).reshape(*d.shape[:-3], k, -1)[..., :n]
        return w.reshape(*d.shape[:-3], *self.shape)

    def unpack(self) -> jax.Array:
        """The parameter in its param_shapes layout: the matrix, or its transpose."""
        return self.matrix().T if self.transposed else self.matrix()

    def rows_of_transpose(self, idx: jax.Array) -> jax.Array:
        """Rows `idx` [...] of the transposed parameter ([V, D] for a packed tied embedding) ->
        [..., K]: column v of the [K, N] matrix is lane v % 64 of tile v // 64, read in place
        (one strided gather; no unpacked copy of the table)."""
        if not self.transposed or self.layer is not None or len(self.shape) != 2:
            raise ValueError(f"rows_of_transpose: a transposed, unstacked [K, N] matrix only (shape {self.shape})")
        tile = self.data.shape[-1]
        return self.data[idx // tile, :, idx % tile]


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)


def _parse(spec: str, w: QuantizedWeight) -> tuple[str, str, str, str, str]:
    """(x letters, out letters, batch letters, contracted letters, weight-output letters)."""
    try:
        lhs, out = spec.replace(" ", "").split("->")
        xl, wl = lhs.split(",")
    except ValueError:
        raise ValueError(f"quantized einsum: spec {spec!r} must read 'x,w->out'") from None
    if "." in spec or len(set(xl)) != len(xl) or len(set(wl)) != len(wl) or len(set(out)) != len(out):
        raise ValueError(f"quantized einsum: spec {spec!r}: no ellipses or repeated letters")
    if len(wl) != len(w.shape) or w.q.ndim != 2:
        raise ValueError(f"quantized einsum {spec!r}: weight letters {wl!r} do not match one matrix of "
                         f"shape {w.shape} (q {w.q.shape}; stacked weights must be sliced per layer)")
    cin = "".join(wl[a] for a in w.in_axes)
    wout = "".join(wl[a] for a in w.out_axes)
    if any(c not in xl or c in out for c in cin) or any(c in xl or c not in out for c in wout):
        raise ValueError(f"quantized einsum {spec!r}: the weight's inputs {cin!r} (in_axes {w.in_axes}) must "
                         f"be contracted with x and its outputs {wout!r} must be kept")
    batch = "".join(c for c in xl if c not in cin)
    if any(c not in out for c in batch) or sorted(out) != sorted(batch + wout):
        raise ValueError(f"quantized einsum {spec!r}: x's other letters {batch!r} must all be outputs")
    return xl, out, batch, cin, wout


def einsum(spec: str, x: jax.Array, w, *, matmul=None, preferred_element_type=None,
           float_matmul=None) -> jax.Array:
    """jnp.einsum(spec, x, w) for a float `w`; for a QuantizedWeight, the same product through
    `matmul`, the model's resolved quantized matmul (one call, fp32 accumulation). Output dtype:
    preferred_element_type if given, else x's dtype. `float_matmul` (the model's
    sharding.float_matmul.FloatMatmul, or None): runs a float `w` instead of jnp.einsum where it
    takes the shapes (few rows, fp32) and `w` is stored contraction-first ([K.., N..])."""
    if not isinstance(w, QuantizedWeight):  # float, packed or not
        y = None if float_matmul is None else _float_einsum(spec, x, w, float_matmul, preferred_element_type)
        if y is not None:
            return y
        w = w.matrix() if isinstance(w, PackedFloatWeight) else w
        return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)
    if matmul is None:
        raise ValueError(f"quantized einsum {spec!r}: a QuantizedWeight needs the model's quantized matmul "
                         f"(matmul=, resolved once from quant_impl: sharding.quantized_matmul.resolve)")
    xl, out, batch, cin, wout = _parse(spec, w)
    if tuple(x.shape[xl.index(c)] for c in cin) != w.in_shape:
        raise ValueError(f"quantized einsum {spec!r}: x {x.shape} does not match the weight's inputs "
                         f"{w.in_shape} (weight shape {w.shape})")
    xt = x if xl == batch + cin else jnp.einsum(f"{xl}->{batch}{cin}", x)
    bshape = xt.shape[:len(batch)]
    y = matmul(xt.reshape(math.prod(bshape), w.in_features), w.q, w.scale, w.zero, bits=w.bits,
               group_size=w.group_size, out_dtype=preferred_element_type or x.dtype, split=w.split)
    y = y.reshape(bshape + w.out_shape)
    return y if out == batch + wout else jnp.einsum(f"{batch}{wout}->{out}", y)


def _float_form(spec: str, x, w, float_matmul, preferred_element_type):
    """(rows, k, n, output shape) of `spec` as x [batch.., K..] @ w [K.., N..] where float_matmul
    takes it (not where the spec has another form, too many rows, not fp32, or a packed weight
    with other contraction dims): else None, and the caller runs jnp.einsum."""
    try:
        ins, out = spec.split("->")
        xl, wl = ins.split(",")
    except ValueError:
        return None
    cin = "".join(c for c in wl if c in xl)
    batch, wout = xl[:len(xl) - len(cin)], wl[len(cin):]
    if not cin or xl != batch + cin or wl != cin + wout or out != batch + wout or set(batch) & set(wout):
        return None
    rows = math.prod(x.shape[:len(batch)])
    k, n = math.prod(w.shape[:len(cin)]), math.prod(w.shape[len(cin):])
    if not float_matmul.takes(rows, x.dtype, w.dtype, preferred_element_type or x.dtype,
                              packed=isinstance(w, PackedFloatWeight)):
        return None
    if isinstance(w, PackedFloatWeight) and len(cin) != w.n_in:
        return None
    return rows, k, n, x.shape[:len(batch)] + tuple(w.shape[len(cin):])


def _float_einsum(spec: str, x, w, float_matmul, preferred_element_type):
    """`spec` as x [batch.., K..] @ w [K.., N..] through float_matmul, or None where it does not
    take it (_float_form): the caller then runs jnp.einsum."""
    form = _float_form(spec, x, w, float_matmul, preferred_element_type)
    if form is None:
        return None
    rows, k, n, shape = form
    out_dtype = preferred_element_type or x.dtype
    x2 = x.reshape(rows, k).astype(jnp.float32)  # a bf16 model's x: the kernel computes in fp32
    if isinstance(w, PackedFloatWeight):
        y = float_matmul.packed(x2, w.data, n, w.layer)
    else:
        y = float_matmul(x2, w.reshape(k, n))
    return y.reshape(shape).astype(out_dtype)


def einsums(specs, x: jax.Array, ws, *, matmul=None, float_matmul=None) -> list:
    """[einsum(spec, x, w) for spec, w in zip(specs, ws)]: products of one input (a layer's q, k
    and v; gate and up). Where the packed native kernel takes every one (all packed, the same
    layer), they run as one call (FloatMatmul.packed_many): one hand-off to XLA's thread pool
    and one wait instead of one a product, where a thread sat idle at the end of each (a GQA
    model's k and v are a few tiles each). Same values, bit for bit."""
    specs, ws = tuple(specs), tuple(ws)
    forms = None
    if (float_matmul is not None and float_matmul.is_packed and len(ws) > 1
            and all(isinstance(w, PackedFloatWeight) and w.layer is ws[0].layer for w in ws)):
        forms = [_float_form(s, x, w, float_matmul, None) for s, w in zip(specs, ws)]
    if not forms or any(f is None for f in forms) or len({f[:2] for f in forms}) != 1:
        return [einsum(s, x, w, matmul=matmul, float_matmul=float_matmul) for s, w in zip(specs, ws)]
    rows, k = forms[0][:2]
    x2 = x.reshape(rows, k).astype(jnp.float32)
    ys = float_matmul.packed_many(x2, [w.data for w in ws], [f[2] for f in forms], ws[0].layer)
    return [y.reshape(f[3]).astype(x.dtype) for y, f in zip(ys, forms)]


def embedding_lookup(table, tokens: jax.Array, dtype) -> jax.Array:
    """Rows `tokens` [...] of an embedding table [V, D] -> [..., D] in `dtype`. A quantized table
    must have shape (V, D) with in_axes (1,) (the tied LM head's layout); only the rows
    looked up are dequantized. A table packed as the tied LM head (PackedFloatWeight, transposed)
    gives its rows from the packed tiles."""
    if isinstance(table, PackedFloatWeight):
        return table.rows_of_transpose(tokens).astype(dtype)
    if not isinstance(table, QuantizedWeight):
        return jnp.take(table, tokens, axis=0).astype(dtype)
    if table.in_axes != (1,) or len(table.shape) != 2 or table.q.ndim != 2:
        raise ValueError(f"embedding_lookup: a quantized table must be one [V, D] matrix with in_axes (1,), "
                         f"got shape {table.shape}, in_axes {table.in_axes}, q {table.q.shape}")
    rows = lambda a: None if a is None else jnp.take(a, tokens, axis=0)[..., None, :]  # noqa: E731
    # Each token's row as a one-row matrix: q [..., 1, D'], scale / zero [..., 1, D/G].
    one = QuantizedWeight(q=rows(table.q), scale=rows(table.scale), zero=rows(table.zero), bits=table.bits,
                          group_size=table.group_size, shape=(1, table.shape[1]), in_axes=(1,))
    return _dequantize_nk(one)[..., 0, :].astype(dtype)


def repeat(w, copies: int, axis: int):
    """jnp.repeat(w, copies, axis) for a float array; for a QuantizedWeight, the same on its
    float layout (`axis` counts the stacked dims, as full_shape does), which must be an output
    axis: whole stored rows are repeated, so the result dequantizes to the repeated float
    weight exactly (replicate_kv_heads uses it for k/v)."""
    if not isinstance(w, QuantizedWeight):
        return jnp.repeat(w, copies, axis=axis)
    lead = len(w.lead_shape)
    a = axis - lead
    if a not in w.out_axes:
        raise ValueError(f"repeat: axis {axis} of a quantized weight of full shape {w.full_shape} "
                         f"(in_axes {w.in_axes}) is not an output axis")
    pos = lead + w.out_axes.index(a)  # where axis `a` sits in N split into out_shape

    def rep(arr):
        if arr is None:
            return None
        split = arr.reshape(arr.shape[:lead] + w.out_shape + arr.shape[-1:])
        out = jnp.repeat(split, copies, axis=pos)
        return out.reshape(arr.shape[:lead] + (-1,) + arr.shape[-1:])
    shape = list(w.shape)
    shape[a] *= copies
    return QuantizedWeight(q=rep(w.q), scale=rep(w.scale), zero=rep(w.zero), bits=w.bits,
                           group_size=w.group_size, shape=tuple(shape), in_axes=w.in_axes)

