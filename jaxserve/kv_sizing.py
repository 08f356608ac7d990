"""How big the KV pool is when nobody said: a pure function of the platform and the device
memory numbers, so it is tested with made-up numbers (tests/test_kv_sizing.py).

  given kv_cache_bytes (or num_pages)  that, as given
  CPU (or no memory statistics)        CPU_KV_CACHE_BYTES, a fixed budget: host memory is
                                       shared with everything else on the machine
  TPU / GPU                            like vLLM's --gpu-memory-utilization: the engine may use
                                       that fraction of each device's memory; what the loaded
                                       weights (bytes_in_use) and an estimate of the step's
                                       activations leave of it holds KV pages. The tightest
                                       device decides, times the devices the pool is split over.
Standard library only.
"""

from __future__ import annotations

from typing import Sequence

from jaxserve.config_base import ConfigError

CPU_KV_CACHE_BYTES = 512 * 2**20


def activation_bytes(max_num_batched_tokens: int, hidden_size: int, intermediate_size: int,
                     vocab_size: int) -> int:
    """A generous estimate of one step's transient buffers (float32): the residual stream and
    q/k/v/o (~8 x hidden), the gated MLP (3 x intermediate) and the logits (vocab) for every
    token of the step. vLLM measures this with a profiling run; an estimate avoids compiling
    before the pool exists, and XLA's own scratch is covered by the 1 - utilization margin."""
    return max_num_batched_tokens * (8 * hidden_size + 3 * intermediate_size + vocab_size) * 4


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def kv_pool_bytes(platform: str, *, kv_cache_bytes: int | None, utilization: float,
                  devices: Sequence[tuple[int, int]] | None = None, activations: int = 0,
                  num_kv_heads: int | None = None) -> tuple[int, str]:
    """(pool bytes over all devices, why). devices: (bytes_limit, bytes_in_use) of each device
    the pool is split over, measured after the weights are loaded; None = no statistics.
    num_kv_heads: the pool is split by KV head, so with more devices than KV heads each device
    holds a whole head (replicated, sharding/rules.py) and the pool grows by only that many."""
    if kv_cache_bytes is not None:
        return kv_cache_bytes, f"kv_cache_bytes={kv_cache_bytes} as given"
    if platform == "cpu" or not devices:
        return CPU_KV_CACHE_BYTES, (f"a fixed {_gib(CPU_KV_CACHE_BYTES)} on {platform} (no device memory to "
                                    f"size from; set kv_cache_bytes for more)")
    per_device_act = activations // len(devices)
    free = [int(limit * utilization) - in_use - per_device_act for limit, in_use in devices]
    limit, in_use = devices[free.index(min(free))]
    if min(free) <= 0:
        raise ConfigError(
            f"gpu_memory_utilization: {utilization} of {_gib(limit)} leaves no room for the KV cache after "
            f"{_gib(in_use)} in use (weights) and ~{_gib(per_device_act)} for activations; raise it, "
            f"lower max_num_batched_tokens or set kv_cache_bytes")
    splits = len(devices) if num_kv_heads is None else min(len(devices), num_kv_heads)
    total = min(free) * splits
    return total, (f"{utilization} x {_gib(limit)} device memory - {_gib(in_use)} in use (weights) - "
                   f"~{_gib(per_device_act)} for activations, on each of {len(devices)} {platform} device(s)"
                   + (f" (KV split {splits} ways: {num_kv_heads} KV heads)" if splits < len(devices) else ""))


def split_kv_pool(pool_bytes: int, full_page_bytes: int, sliding_page_bytes: int,
                  sliding_pages_wanted: int) -> tuple[int, int]:
    """(full pool pages, sliding pool pages), null pages included, for a model whose full and
    sliding layers keep KV in two page groups (scheduler/window.py). The rule: a sliding
    layer's sequence never holds more than its window peak (admission.peak_pages), so its pool
    gets `sliding_pages_wanted` (max_num_seqs sequences at that peak, + the null page), but
    never more pages than an even split would give it (every layer the same page count, as one
    group has); the full layers get every byte left, so their pool is never smaller than an
    even split's and a sequence is never refused for the split."""
    even = pool_bytes // (full_page_bytes + sliding_page_bytes)
    sliding = max(2, min(even, sliding_pages_wanted))
    full = max(2, (pool_bytes - sliding * sliding_page_bytes) // full_page_bytes)
    return full, sliding
