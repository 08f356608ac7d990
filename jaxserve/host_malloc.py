"""On the CPU backend, the memory of each step's temporaries kept mapped from one step to the next.

Why: XLA:CPU mallocs an executable's temporaries as one block on every run and frees it after
(SmolLM2's step: 14 MB at 8 rows, 85 MB at 48 rows and in every prefill bucket). glibc serves a
block that size with a fresh mmap: its mmap threshold tops out at 32 MiB, and XLA's worker
threads, which run the steps, allocate from arenas of their own, whose heaps cannot hold more
than 64 MiB, mmap anything larger whatever the threshold and are unmapped whole once free. So
every step page-faults on each 4 KiB page it writes, and the kernel zeroes the page first:
~6,000 faults a 48-row step (`perf record -e page-faults`: the LM head's logits, XLA's
fusions, copies), about a tenth of the process's CPU time spent in the kernel. Measured on a
2-core Intel Xeon (KVM, AVX-512), 48 greedy requests of 40 tokens through jaxserve.LLM: 287,000
faults and 3.7-3.9 s a run before, 12 faults and 3.6 s after; bench_offline's natural-text run
(`--no-host-reuse-step-memory` against the default, three interleaved runs each), its 48-row
decode steps 95.4-99.6 -> 87.5-91.1 ms, 24 rows 64.0-67.2 -> 59.6-63.9, useful tok/s median
154.0 -> 155.8 (most of that run is prefill and small batches); a greedy 48-row sampler call
alone 4.6 -> 2.0 ms.

What is set (glibc's mallopt; nothing on another C library):
  limit_arenas()      one malloc arena for the process (M_ARENA_MAX = 1) before JAX starts its
                      CPU client: a thread keeps the arena of its first malloc, so XLA's threads,
                      created with the client, then allocate from the main heap. `import
                      jaxserve` does it, as early as a script can, unless JAX's backend already
                      started (then nothing changes, and warm-up says why), JAX may start a GPU or
                      TPU backend here (JAX_PLATFORMS, accelerator plugins installed), or
                      GLIBC_TUNABLES sets glibc.malloc.arena_max (the user's choice).
  keep_step_memory()  the runner's warm-up, once the weights and KV cache are placed (each its
                      own mmap, as before, so the memory loading used went back to the system):
                      malloc no longer mmaps (M_MMAP_MAX = 0), so a step's block is the previous
                      step's pages. XLA frees a run's block once its outputs are ready, so the
                      next run can allocate before the last one's is back, the more so on a
                      loaded machine (measured: three to five blocks live at once there). So the
                      heap top keeps KEPT_BLOCKS (2) largest blocks mapped even when it trims
                      (M_TOP_PAD), and trims only past TRIM_BLOCKS (4) blocks plus 64 MiB free
                      (M_TRIM_THRESHOLD; with a threshold of two blocks and no pad, a loaded
                      machine grew and trimmed the heap every other run, faulting a block each
                      time). Then it mallocs and writes two blocks at once and frees them, so
                      the heap holds them from warm-up on (the first steps served fault
                      nothing, and RSS after warm-up counts them).
The cost: what the process mallocs after that (the step blocks, which are reused; a large host
array such as prompt logprobs) comes from the heap and stays resident once freed: two largest
step blocks at least (SmolLM2's default buckets: 2 x 108 MiB). Performance
only: `--no-host-reuse-step-memory` (EngineConfig.host_reuse_step_memory) skips the second part;
the first alone changes no measured figure.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

# glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
KEPT_BLOCKS = 2  # largest step blocks the heap keeps mapped at its top whatever happens (M_TOP_PAD)
TRIM_BLOCKS = 4  # ...and the free top it lets grow, in blocks, before it trims back to KEPT_BLOCKS

_lock = threading.Lock()
_arenas: str | None = None  # "one" once limited; else why not (None: not asked yet)
_declined: str | None = None
_top_pad = _trim_threshold = 0


def _glibc():
    """The process's C library when it is glibc (it has gnu_get_libc_version), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        return libc
    except (OSError, AttributeError):
        return None


def _tunables_arena_max() -> str | None:
    """The arena limit GLIBC_TUNABLES gave the process at its start, if any: the user's choice."""
    for item in os.environ.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = item.strip().partition("=")
        if name == "glibc.malloc.arena_max":
            return value
    return None


def _jax_started() -> bool:
    """Whether JAX has started a backend (and with it XLA's threads), without importing jax."""
    xla_bridge = sys.modules.get("jax._src.xla_bridge")
    return xla_bridge is not None and xla_bridge.backends_are_initialized()


def _accelerator_possible() -> str | None:
    """Why JAX might start a backend other than the CPU here, or None when it cannot: one arena
    is for the CPU backend's threads, not for a GPU or TPU host's compiler threads. Without
    importing jax: JAX_PLATFORMS (jax's config once jax is imported), else the accelerator
    plugins installed (the jax_plugins entry points and namespace, libtpu)."""
    import importlib.util
    import pkgutil
    from importlib import metadata

    jax = sys.modules.get("jax")
    platforms = (getattr(jax, "config", None) and jax.config.jax_platforms) or os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        first = platforms.split(",")[0].strip()
        return None if first == "cpu" else f"JAX_PLATFORMS starts with {first}"
    found = sorted({e.name for e in metadata.entry_points(group="jax_plugins")})
    if importlib.util.find_spec("jax_plugins") is not None:
        import jax_plugins
        found += sorted(m.name for m in pkgutil.iter_modules(jax_plugins.__path__))
    if importlib.util.find_spec("libtpu") is not None:
        found.append("libtpu")
    if not found:
        return None
    return f"JAX may start an accelerator backend ({', '.join(found)} installed; JAX_PLATFORMS=cpu says it will not)"


def limit_arenas() -> str | None:
    """One malloc arena, unless JAX's backend has started: None when done (or already), else why
    not, in words for the warm-up log."""
    global _arenas
    with _lock:
        if _arenas is None:
            _arenas = _limit_arenas()
        return None if _arenas == "one" else _arenas


def _limit_arenas() -> str:
    libc = _glibc()
    if libc is None:
        return "not glibc's malloc"
    tunable = _tunables_arena_max()
    if tunable is not None:
        return "one" if tunable == "1" else f"GLIBC_TUNABLES sets glibc.malloc.arena_max={tunable}"
    accelerator = _accelerator_possible()
    if accelerator:
        return f"{accelerator}: there a step's temporaries live in device memory, not malloc's"
    if _jax_started():
        return ("JAX's backend started before jaxserve was imported, so XLA's threads keep malloc arenas "
                "of their own (import jaxserve first, or start Python with GLIBC_TUNABLES=glibc.malloc.arena_max=1)")
    if libc.mallopt(_M_ARENA_MAX, 1) != 1:
        return "mallopt(M_ARENA_MAX, 1) was refused"
    return "one"


def _touch(libc, nbytes: int, blocks: int = 2) -> None:
    """malloc and write `blocks` blocks of nbytes at once, then free them: the heap grows to hold
    them now, at warm-up (and RSS after warm-up counts them), not in the first steps served.
    Two: XLA frees a run's block once its outputs are ready, so the next run can allocate before
    the last one's is back (under load, measured: the heap grew by one block, all its pages
    faulting once, in the first few runs)."""
    if nbytes <= 0:
        return
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    held = [libc.malloc(nbytes) for _ in range(blocks)]
    for block in held:
        if block:
            ctypes.memset(block, 0, nbytes)
    for block in held:
        if block:
            libc.free(block)


def decline(why: str) -> None:
    """keep_step_memory changes nothing for the rest of the process (its settings are
    process-wide and one-way: a test process, an application with its own allocator policy);
    `why` is what the warm-up log then says."""
    global _declined
    with _lock:
        _declined = why


def keep_step_memory(largest_block: int) -> str:
    """No more mmap for malloc, and a trim threshold above `largest_block` (bytes: the largest
    step's temporaries), when the arenas were limited; a sentence for the warm-up log either way."""
    global _top_pad, _trim_threshold
    limit_arenas()  # what import did; a no-op answer from then on
    with _lock:
        why = _declined or (None if _arenas == "one" else _arenas)
        if why:
            return f"step temporaries mapped afresh each step: {why}"
        libc = _glibc()
        # mallopt takes a C int: past 2 GiB, blocks are kept and trimmed by less than they should be
        pad = min(max(_top_pad, KEPT_BLOCKS * largest_block), 2**31 - 1)
        threshold = min(max(_trim_threshold, TRIM_BLOCKS * largest_block + (64 << 20)), 2**31 - 1)
        if any(libc.mallopt(opt, value) != 1 for opt, value in
               ((_M_MMAP_MAX, 0), (_M_TOP_PAD, pad), (_M_TRIM_THRESHOLD, threshold))):
            return "step temporaries mapped afresh each step: mallopt refused M_MMAP_MAX, M_TOP_PAD or M_TRIM_THRESHOLD"
        _top_pad, _trim_threshold = pad, threshold
        _touch(libc, largest_block, KEPT_BLOCKS)
        return (f"step temporaries kept mapped between steps: glibc malloc, one arena, no mmap, "
                f"{_top_pad / 2**20:.0f} MiB kept at the heap top, trimmed back to that past "
                f"{_trim_threshold / 2**20:.0f} MiB free (largest step block {largest_block / 2**20:.0f} MiB)")
