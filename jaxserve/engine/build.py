"""From the configs to a running engine, in one place for every entry point (jaxserve.LLM,
`jaxserve serve`, the scripts): the mesh (`engine_mesh`, checked against `tp`), `--dtype auto`
resolved for the backend, the model loaded, the KV pool sized (jaxserve/kv_sizing.py), and one
log line saying what was chosen and why.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np

from jaxserve.config import ConfigError, EngineConfig, LoadConfig, resolve_dtype
from jaxserve.kv_sizing import activation_bytes, kv_pool_bytes

log = logging.getLogger("jaxserve.engine")


def engine_mesh(tp: int, devices=None):
    """The ("dp", "tp") mesh an engine with tensor-parallel degree `tp` runs on (None for one
    device): over `devices` (default: every device of the job). The one place a mesh is made."""
    import jax

    from sharding.mesh import make_mesh
    devices = list(devices if devices is not None else jax.devices())
    if tp > len(devices):
        raise ConfigError(f"tp: {tp} needs {tp} devices, this process sees {len(devices)} "
                          f"({devices[0].platform if devices else 'none'})")
    return None if tp == 1 else make_mesh(tp=tp, devices=devices)


def check_mesh(mesh, tp: int) -> None:
    have = 1 if mesh is None else mesh.shape["tp"]
    if have != tp:
        raise ConfigError(f"tp: the engine config says {tp}, the mesh it was given has tp={have}")


def size_kv_pool(config: EngineConfig, model, mesh) -> tuple[EngineConfig, str]:
    """`config` with kv_cache_bytes filled in (unless num_pages is given), and why."""
    import jax
    if config.num_pages is not None:
        return config, f"num_pages={config.num_pages} as given"
    devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
    mem = None
    if devices[0].platform != "cpu" and config.kv_cache_bytes is None:
        # This process's devices (memory_stats answers for addressable ones only); the others
        # of a multi-process mesh hold the same shapes.
        stats = [d.memory_stats() or {} for d in devices if d.process_index == jax.process_index()]
        if stats and all("bytes_limit" in s and "bytes_in_use" in s for s in stats):
            mem = [(s["bytes_limit"], s["bytes_in_use"]) for s in stats] * (len(devices) // len(stats))
    cfg = model.cfg
    act = activation_bytes(config.max_num_batched_tokens, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size)
    pool, why = kv_pool_bytes(devices[0].platform, kv_cache_bytes=config.kv_cache_bytes,
                              utilization=config.gpu_memory_utilization, devices=mem, activations=act,
                              num_kv_heads=cfg.num_kv_heads)
    sized = dataclasses.replace(config, kv_cache_bytes=pool)
    return sized, why


def check_same_vocabulary(target, draft) -> None:
    """A draft's tokens must mean the target's: one line naming the first id that differs."""
    from jaxserve.config_base import ConfigError
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"speculative_model: its tokenizer has {draft.vocab_size} tokens, the target's "
                          f"{target.vocab_size}")
    for i in range(target.vocab_size):
        a, b = target.id_to_token(i), draft.id_to_token(i)
        if a != b:
            raise ConfigError(f"speculative_model: token {i} is {b!r} in the draft's tokenizer, {a!r} in the "
                              f"target's: a draft must share the target's tokenizer")


def build_engine(load: LoadConfig, config: EngineConfig, mesh=None, *, local_devices: bool = False,
                 progress: bool = False):
    """(LoadedModel, Engine) for these configs. mesh: a mesh made by the caller (a multi-process
    server after jax.distributed), else made here from config.tp; local_devices: over this
    process's devices only (offline replicas, scripts/generate_batch.py); progress: a bar over
    the tensors loaded (on a terminal)."""
    import jax

    from jaxserve import loading
    from jaxserve.engine.engine import Engine
    platform = jax.default_backend()
    dtype = resolve_dtype(load.dtype, platform)
    if mesh is None:
        mesh = engine_mesh(config.tp, jax.local_devices() if local_devices else None)
    check_mesh(mesh, config.tp)
    if load.speculative_model is not None and not Path(load.speculative_model).exists():
        from jaxserve.config_base import ConfigError  # before the target's load, not after it
        raise ConfigError(f"speculative_model: {load.speculative_model} does not exist (expected an HF folder, "
                          f"a .gguf file or an Orbax folder)")
    lm = loading.load(load.model, dtype, mesh, quantize=load.quantize,
                      quantize_group_size=load.quantize_group_size, quant_impl=load.quant_impl,
                      matmul_impl=load.matmul_impl, progress=progress)
    config, why = size_kv_pool(config, lm.model, mesh)
    draft = None
    if load.wants_draft_model:
        draft = loading.load(load.speculative_model or load.model, dtype, None, quantize=load.speculative_quantize,
                             quant_impl=load.quant_impl, progress=progress)
        check_same_vocabulary(lm.tokenizer, draft.tokenizer)
        log.info("draft model: %s (%s)", load.speculative_model or "the target's checkpoint", draft.weights)
    engine = Engine(lm.model, lm.tokenizer, config, lm.eos_token_ids, mesh=mesh,
                    draft_model=None if draft is None else draft.model)
    sc = engine.scheduler_config
    itemsize = np.dtype(lm.model.dtype).itemsize
    kv_bytes = sc.num_pages * config.kv_bytes_per_page(lm.config, itemsize)
    if sc.sliding_window is not None:  # two KV groups (scheduler/window.py), split by kv_sizing.split_kv_pool
        full, sliding = lm.config.kv_groups()
        fb, sb = (n * config.kv_bytes_per_page(lm.config, itemsize, len(g))
                  for n, g in ((sc.num_pages, full), (sc.num_sliding_pages, sliding)))
        kv_bytes = fb + sb
        log.info("KV page groups: %d full-attention layers keep every page: %d pages, %.2f GiB; %d sliding "
                 "layers free the pages behind their %d-token window: %d pages, %.2f GiB", len(full),
                 sc.num_usable_pages, fb / 2**30, len(sliding), sc.sliding_window, sc.num_sliding_pages - 1,
                 sb / 2**30)
    log.info("dtype %s%s; KV cache %d pages x %d tokens = %d tokens, %.2f GiB (%s): %s", dtype,
             f" (auto on {platform})" if load.dtype == "auto" else "", sc.num_usable_pages, sc.page_size,
             sc.num_usable_pages * sc.page_size, kv_bytes / 2**30,
             config.kv_cache_dtype if config.kv_cache_dtype != "auto" else dtype, why)
    return lm, engine


def build_llm(args, prog: str, **overrides):
    """jaxserve.LLM from the flags add_engine_flags made (the offline scripts); a refused value
    or combination exits 2 in one line before the load, a bad model after it in one line too."""
    import sys

    from checkpoints import CheckpointError
    from jaxserve import LLM, flags
    load, engine = flags.engine_configs_or_exit(args, prog, **overrides)
    try:
        return LLM(progress=flags.progress_enabled(args), **flags.llm_kwargs(load, engine))
    except (ValueError, CheckpointError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
