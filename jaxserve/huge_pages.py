"""The engine's big host buffers (weights, KV cache) on 2 MiB pages, on the CPU backend.

Why: a decode step reads every weight and the KV of every running sequence. A KV page (16
tokens of SmolLM2: 12 KB of K, 12 KB of V per layer) sits anywhere in a pool of hundreds of MB,
so on 4 KiB pages nearly every page of KV the attention kernel reads starts with a TLB miss and
a page walk, and the LM head's and projections' long reads take one every 4 KiB too. Linux maps
2 MiB pages (transparent huge pages) where a process asks for them (THP "madvise", the usual
default) or everywhere ("always"); XLA's CPU allocator does not ask. Measured on a 2-core Intel
Xeon (KVM, AVX-512): 30 layers of 48 decode rows' attention at contexts 600-2,000, the kernel
alone, 175 -> 149 ms; profile_decode's whole decode step at those contexts 29.0 -> 26.7 ms at 1
row, 94.7 -> 87.9 at 16, 250 -> 221 at 48; bench_offline's default natural-text run (short
contexts, so less KV) 137.3 -> 141.3 useful tok/s, medians of 3 interleaved runs, its 1-row
steps 28.6 -> 26.7 ms (`--no-host-huge-pages` for the "before"); the AVX2 build there 109.0 ->
112.8 tok/s, its 1-row steps 28.0 -> 24.6 ms.

So the engine asks, for the buffers it keeps for its lifetime: madvise(MADV_HUGEPAGE) on the
2 MiB-aligned part of each (later faults there take huge pages), then MADV_COLLAPSE (Linux
6.1+), which moves the pages already written into huge pages now rather than whenever
khugepaged reaches them (16 MB every 10 s by default). The KV cache is donated to every step,
so the step writes it in place and its buffer (and its pages) stay the same.

Performance only: the bytes are the same either way. What could not be done is said once
(`HugePages.describe`), never an error: THP off ("never"), a kernel without MADV_COLLAPSE, no
2 MiB run free. The figures are what /proc/self/smaps shows afterwards, not what madvise
returned. Buffers under glibc's mmap threshold (at most 32 MiB) live in heap mappings other
allocations share, where glibc's trimming of freed neighbours can split huge pages again; the
engine's stacked weights and its KV pool are each a mapping of their own.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import re
import sys
import threading
from pathlib import Path

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclasses.dataclass
class HugePages:
    """What back_with_huge_pages did: bytes in 2 MiB-aligned ranges asked for, bytes the kernel
    reports on huge pages there afterwards, and why not all (None when all)."""
    asked_bytes: int = 0
    huge_bytes: int = 0
    why_not: str | None = None

    def describe(self, what: str) -> str:
        if self.asked_bytes == 0:
            return f"{what} on 4 KiB pages: {self.why_not or 'no buffer spans a 2 MiB page'}"
        line = (f"{what} on 2 MiB pages: {self.huge_bytes / 2**20:.0f} of {self.asked_bytes / 2**20:.0f} MiB "
                f"(transparent huge pages)")
        return line if self.why_not is None else f"{line}; {self.why_not}"


def thp_mode() -> str | None:
    """The system's transparent-huge-page mode ("always", "madvise", "never"), None off Linux."""
    try:
        text = _THP_ENABLED.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("["):
            return word.strip("[]")
    return None


def _kernel() -> tuple[int, int]:
    """(major, minor) of the running Linux, e.g. (6, 1) for "6.1-rc3" or "6.1.0-13-amd64"."""
    m = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return (int(m[1]), int(m[2])) if m else (0, 0)


def host_ranges(arrays) -> list[tuple[int, int]]:
    """(start, length) of the 2 MiB-aligned middle of every host buffer of these jax arrays
    (each addressable shard's), where one spans at least a whole huge page."""
    import jax
    out = []
    for x in jax.tree.leaves(arrays):
        if not isinstance(x, jax.Array) or x.is_deleted():
            continue
        # Written first: dispatch is asynchronous, and a buffer XLA is still filling changes
        # under madvise (MADV_COLLAPSE gave EINVAL / EAGAIN and half the pages on a fresh cache).
        x.block_until_ready()
        for shard in x.addressable_shards:
            if shard.device.platform != "cpu":
                continue
            ptr, n = shard.data.unsafe_buffer_pointer(), shard.data.nbytes
            start = -(-ptr // HUGE_PAGE) * HUGE_PAGE
            end = (ptr + n) // HUGE_PAGE * HUGE_PAGE
            if end > start:
                out.append((start, end - start))
    return _union(out)


def _union(ranges) -> list[tuple[int, int]]:
    """Sorted, overlapping or touching ranges merged (Linux merges such VMAs too)."""
    merged: list[list[int]] = []
    for start, n in sorted(ranges):
        if merged and start <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], start + n - merged[-1][0])
        else:
            merged.append([start, n])
    return [(s, n) for s, n in merged]


def resident_huge_bytes(ranges) -> int:
    """Bytes of these ranges the kernel maps with huge pages now, from /proc/self/smaps: each
    mapping's AnonHugePages, up to the part of it inside the ranges. Exact where a mapping holds
    nothing but asked-for bytes (madvise splits mappings at a range's edges; a buffer of its own
    mmap is one); a heap mapping merged with other advised memory may credit a range with a
    neighbour's huge pages."""
    ranges, total = _union(ranges), 0
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    overlap = 0
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            overlap = sum(max(0, min(hi, s + n) - max(lo, s)) for s, n in ranges)
        elif overlap and head == "AnonHugePages:":
            total += min(overlap, int(line.split()[1]) * 1024)
    return total


def back_with_huge_pages(arrays) -> HugePages:
    """Ask Linux to keep these arrays' host buffers on 2 MiB pages now (see the module doc)."""
    return advise(host_ranges(arrays))


class InBackground:
    """back_with_huge_pages on a thread of its own: MADV_COLLAPSE copies every 4 KiB page it
    moves, 0.3-2.9 s a GiB measured on the Xeon above (the most when the hypervisor first hands
    the VM the memory), which the engine's warm-up compilations (one core) hide. The ranges are
    taken here, while the arrays are alive (a step deletes the donated cache's array object, not
    its buffer); moving pages under running code is safe (khugepaged does it to every process)."""

    def __init__(self, arrays):
        self.ranges = host_ranges(arrays)
        self._report = HugePages()
        self._thread = None
        if self.ranges:  # no buffer spans a huge page: no thread
            self._thread = threading.Thread(target=self._run, name="jaxserve-huge-pages", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        self._report = advise(self.ranges)

    def result(self) -> HugePages:
        """The report, once the thread is done (waits for it)."""
        if self._thread is not None:
            self._thread.join()
        return self._report


def advise(ranges) -> HugePages:
    """MADV_HUGEPAGE, then MADV_COLLAPSE, on these 2 MiB-aligned (start, length) ranges."""
    if not sys.platform.startswith("linux"):
        return HugePages(why_not=f"transparent huge pages are Linux's ({sys.platform} here)")
    mode = thp_mode()
    if mode in (None, "never"):
        return HugePages(why_not="transparent huge pages are off here "
                                 f"({_THP_ENABLED} says {mode or 'nothing'})")
    report = HugePages(asked_bytes=sum(n for _, n in ranges))
    if not ranges:
        return report
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    failures = set()
    for start, n in ranges:
        for advice in (_MADV_HUGEPAGE, _MADV_COLLAPSE):
            if libc.madvise(start, n, advice) != 0:
                failures.add((advice, ctypes.get_errno()))
    report.huge_bytes = resident_huge_bytes(ranges)
    if report.huge_bytes < report.asked_bytes:
        why = []
        kernel = _kernel()
        for advice, err in sorted(failures):
            if advice == _MADV_COLLAPSE and err == errno.EINVAL and kernel < (6, 1):
                why.append(f"Linux {kernel[0]}.{kernel[1]} has no MADV_COLLAPSE (6.1+): the rest "
                           f"moves when khugepaged reaches it")
            else:
                name = "MADV_HUGEPAGE" if advice == _MADV_HUGEPAGE else "MADV_COLLAPSE"
                why.append(f"{name}: {os.strerror(err)}")
        report.why_not = "; ".join(why) or "the kernel left some on 4 KiB pages"
    return report
