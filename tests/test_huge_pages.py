"""The runner's weights and KV cache on 2 MiB pages (jaxserve/huge_pages.py): what the kernel
reports in /proc/self/smaps, not what madvise returned, and that the pages stay huge while
steps run (the donated cache is written in place)."""

from __future__ import annotations

import ctypes
import mmap
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import drain, make_engine

from jaxserve import huge_pages as hp
from jaxserve.types import SamplingParams

MB2 = 2 << 20
# Buffers past glibc's largest mmap threshold (32 MiB), so each is a mapping of its own, as the
# engine's stacked weights and its KV pool are: smaller ones come from the heap, whose VMAs other
# allocations share and whose freed chunks glibc trims with MADV_DONTNEED (splitting huge pages).
BIG = 40 << 20


def collapse_expected() -> bool:
    """Whether this machine can move written pages onto huge pages now: THP not off, not off
    for this process either (prctl PR_SET_THP_DISABLE, inherited from a launcher or container:
    /proc/self/status says THP_enabled: 0), and a kernel with MADV_COLLAPSE (Linux 6.1+)."""
    status = Path("/proc/self/status").read_text() if Path("/proc/self/status").exists() else ""
    disabled = re.search(r"^THP_enabled:\s*0\s*$", status, re.M) is not None
    return hp.thp_mode() in ("madvise", "always") and not disabled and hp._kernel() >= (6, 1)


def aligned_middle(ptr: int, n: int) -> int:
    """Bytes of [ptr, ptr + n) between its first and last 2 MiB boundary."""
    lo, hi = -(-ptr // MB2) * MB2, (ptr + n) // MB2 * MB2
    return max(0, hi - lo)


def test_an_array_moves_onto_huge_pages_and_keeps_its_values():
    x = jnp.arange(BIG // 4, dtype=jnp.float32) * 3 + 1
    small = jnp.ones((1000,), jnp.float32)                       # spans none: not asked for
    before = np.asarray(x).copy()
    report = hp.back_with_huge_pages({"x": x, "small": small})
    assert report.asked_bytes == aligned_middle(x.unsafe_buffer_pointer(), x.nbytes) >= BIG - MB2
    if collapse_expected():
        assert report.huge_bytes == report.asked_bytes and report.why_not is None, report
        assert "2 MiB pages: " in report.describe("x")
    else:
        assert report.why_not, report
    np.testing.assert_array_equal(np.asarray(x), before)
    np.testing.assert_array_equal(np.asarray(x * 2), before * 2)


def test_smaps_counts_only_the_ranges_asked_for():
    x = jnp.zeros(BIG // 4, jnp.float32) + 1
    y = jnp.zeros(BIG // 4, jnp.float32) + 2
    report = hp.back_with_huge_pages([x, y])
    if not collapse_expected():
        pytest.skip(f"this machine cannot collapse pages: {report.why_not}")
    (xs, xn), = hp.host_ranges(x)
    (ys, yn), = hp.host_ranges(y)
    assert hp.resident_huge_bytes([(xs, xn)]) == xn  # y's huge pages are not x's
    assert hp.resident_huge_bytes([(ys, yn)]) == yn
    assert hp.resident_huge_bytes([(xs, xn), (ys, yn)]) == xn + yn
    assert hp.resident_huge_bytes([(xs, xn - MB2)]) == xn - MB2  # part of it
    assert hp.resident_huge_bytes([]) == 0
    # Memory this test wrote on 4 KiB pages of its own (MADV_NOHUGEPAGE holds under THP
    # "always" too). Not "the 2 MiB before x": that is whatever mapping the allocator put
    # there, on CI once a live engine's KV cache, on huge pages. Private anonymous memory, as
    # jax's buffers are: mmap's default, MAP_SHARED, is shmem, which smaps never counts in
    # AnonHugePages (the check would pass whatever resident_huge_bytes did).
    with mmap.mmap(-1, 4 * MB2, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as small_pages:
        small_pages.madvise(mmap.MADV_NOHUGEPAGE)
        small_pages.write(b"\1" * len(small_pages))
        view = ctypes.c_char.from_buffer(small_pages)
        try:
            at = -(-ctypes.addressof(view) // MB2) * MB2
            assert hp.resident_huge_bytes([(at, 2 * MB2)]) == 0
            assert hp.resident_huge_bytes([(at, 2 * MB2), (xs, xn)]) == xn
        finally:
            del view  # the mmap cannot close while a ctypes view holds its buffer


def test_ranges_that_touch_are_one_range():
    assert hp._union([(10, 5), (0, 10), (30, 2), (31, 4)]) == [(0, 15), (30, 5)]


def test_with_huge_pages_off_the_report_says_why_and_asks_for_nothing(monkeypatch):
    monkeypatch.setattr(hp, "thp_mode", lambda: "never")
    report = hp.back_with_huge_pages(jnp.zeros((8 << 20) // 4, jnp.float32))
    assert report.asked_bytes == 0 and "off here" in report.why_not
    assert report.describe("weights").startswith("weights on 4 KiB pages: transparent huge pages are off")


def test_the_engine_keeps_its_kv_cache_on_huge_pages_while_it_steps(tiny_model):
    model, tok = tiny_model
    # The tiny model's K and V caches are 256 bytes a page a layer: 81,920 pages make each a
    # 40 MiB buffer (its weights span no huge page).
    eng = make_engine(model, tok, num_pages=BIG // 512)
    runner = eng.runner
    leaves = jax.tree.leaves(runner.cache)
    ptrs = [x.unsafe_buffer_pointer() for x in leaves]
    report = runner.huge_pages_report()
    assert report.asked_bytes == sum(aligned_middle(p, x.nbytes) for p, x in zip(ptrs, leaves)) >= 2 * (BIG - MB2)
    if not collapse_expected():
        assert report.why_not, report
        return
    assert report.huge_bytes == report.asked_bytes, report
    rng = np.random.default_rng(0)
    for i in range(6):
        eng.add_request({"prompt_token_ids": rng.integers(0, 256, 40).tolist()},
                        SamplingParams(max_tokens=12, ignore_eos=True), request_id=str(i))
    drain(eng)
    after = jax.tree.leaves(runner.cache)
    # Donated to every step, written in place: the same buffers, still on huge pages.
    assert [x.unsafe_buffer_pointer() for x in after] == ptrs
    assert hp.resident_huge_bytes(hp.host_ranges(runner.cache)) == report.asked_bytes


def test_host_huge_pages_off_makes_no_request(tiny_model):
    model, tok = tiny_model
    eng = make_engine(model, tok, num_pages=BIG // 512, host_huge_pages=False)
    assert eng.runner.huge_pages_report() is None


def test_the_dense_generator_moves_its_weights_onto_huge_pages(smollm2):
    from jaxserve.engine.dense_generator import DenseGenerator
    gen = DenseGenerator(smollm2.model, smollm2.eos_token_ids)
    report = gen.huge_pages.result()
    weights = jax.tree.leaves(gen._state)
    assert report.asked_bytes == sum(aligned_middle(x.unsafe_buffer_pointer(), x.nbytes) for x in weights)
    own_mapping = [x for x in weights if x.nbytes >= BIG]  # where smaps' count is exact
    assert sum(x.nbytes for x in own_mapping) > 400 << 20
    if not collapse_expected():
        assert report.why_not, report
        return
    for x in own_mapping:
        ranges = hp.host_ranges(x)
        assert hp.resident_huge_bytes(ranges) == sum(n for _, n in ranges), x.shape
