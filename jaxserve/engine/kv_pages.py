"""A request's KV pages read out of the paged cache and written into another one, in the cache's
stored layout (plain `[L, P, page, K * H]`, int8 values with their bf16 scales `[L, P, K, page]`
(lane-dense scales, the TPU kernel's, leave as those page rows too: kv_cache.page_scales),
a two-group model's full and sliding groups each from its own pages): the data a prefill engine
hands a decode engine (engine/handover.py). Every array has the page (or, lane-dense scales, the
page's row) on axis 1, so a read is one gather along it (plus the page's lanes of its scale row)
and a write one scatter, with no relayout.

The page count is padded to a power of two with the null page (page 0, which the scheduler
never hands out and whose contents nothing reads), so a few programs serve every request
length: reads of padding rows carry junk, writes of them land in the null page. The write
donates the cache, as a step does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.paged_attention import GroupedKV
from pallas_kernels import kv_cache


def bucket(n: int) -> int:
    """The padded page count for n pages: the next power of two (at least 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def padded(pages) -> np.ndarray:
    p = np.zeros(bucket(len(pages)), np.int32)
    p[:len(pages)] = pages
    return p


def _gather(cache, pages):
    def side(x):
        if not kv_cache.is_quantized(x):
            return jnp.take(x, pages, axis=1)
        # Scales leave page by page, [L, n, K', page], whichever layout the cache keeps them in.
        return kv_cache.QuantizedKV(jnp.take(x.values, pages, axis=1),
                                    kv_cache.page_scales(x.scales, pages, x.values.shape[2]))
    return jax.tree.map(side, cache, is_leaf=kv_cache.is_cache_side)


def _scatter(cache, pages, data):
    def side(x, d):
        if not kv_cache.is_quantized(x):
            return x.at[:, pages].set(d.astype(x.dtype))
        return kv_cache.QuantizedKV(x.values.at[:, pages].set(d.values.astype(x.values.dtype)),
                                    kv_cache.put_page_scales(x.scales, pages, d.scales, x.values.shape[2]))
    return jax.tree.map(side, cache, data, is_leaf=kv_cache.is_cache_side)


@functools.lru_cache(maxsize=None)
def _jitted(tree, shardings: tuple):
    """The read and write programs for a cache group placed on these shardings, which the pages'
    arrays keep too (kv_pages.specs). Pinned rather than inferred: jit keys its cache on whether
    each input is committed to a device, and a cache the step programs return (uncommitted on
    one device) met data pulled from a peer (committed) in programs warm-up had not compiled."""
    sh = jax.tree.unflatten(tree, shardings)
    return (jax.jit(_gather, in_shardings=(sh, None), out_shardings=sh),
            jax.jit(_scatter, donate_argnums=0, in_shardings=(sh, None, sh), out_shardings=sh))


def _programs(group):
    leaves, tree = jax.tree.flatten(group)
    return _jitted(tree, tuple(x.sharding for x in leaves))


def _groups(cache):
    return (cache.full, cache.sliding) if isinstance(cache, GroupedKV) else (cache,)


def read(cache, full_pages, sliding_pages=()) -> tuple:
    """The pages' contents: one pytree per KV group (a group's leaves `[L, bucket(n), ...]`)."""
    groups = _groups(cache)
    wanted = (full_pages, sliding_pages)[:len(groups)]
    return tuple(_programs(g)[0](g, jnp.asarray(padded(p))) for g, p in zip(groups, wanted))


def write(cache, full_pages, sliding_pages, data: tuple):
    """`cache` with `data` (what `read` returned, any padding) written into these pages."""
    groups = _groups(cache)
    wanted = (full_pages, sliding_pages)[:len(groups)]
    new = []
    for g, p, d in zip(groups, wanted, data):
        rows = jax.tree.leaves(d)[0].shape[1]
        if rows != bucket(len(p)):
            raise ValueError(f"KV data of {rows} pages for {len(p)} pages (expected {bucket(len(p))})")
        new.append(_programs(g)[1](g, jnp.asarray(padded(p)), d))
    return GroupedKV(*new) if isinstance(cache, GroupedKV) else new[0]


def specs(cache, num_full: int, num_sliding: int = 0) -> tuple:
    """The shapes, dtypes and shardings `read` returns for these page counts: what a receiver
    pulls (engine/handover.py, disagg/kv_transfer.py)."""
    out = []
    for g, n in zip(_groups(cache), (num_full, num_sliding)):
        out.append(jax.eval_shape(_gather, g, jax.ShapeDtypeStruct((bucket(n),), jnp.int32)))
        # eval_shape drops shardings: the pages' arrays keep the cache's, split by heads as it is.
        out[-1] = jax.tree.map(lambda d, x: jax.ShapeDtypeStruct(d.shape, d.dtype, sharding=x.sharding),
                               out[-1], g)
    return tuple(out)


def nbytes(data: tuple) -> int:
    """Bytes of the arrays in `data` (a fake runner's data, holding none, counts 0)."""
    return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(data))
