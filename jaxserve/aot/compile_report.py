"""`jaxserve compile`: the engine's step programs compiled for a machine this process is not on.

Data flow:
  topology name -> compile-only devices + chip figures (targets.py)
  config.json -> ModelConfig -> a model of abstract weights (abstract_model.py), in the dtype and
      weight format the flags ask for, backends resolved for the target's platform
      (sharding.backends.targeting: pallas_tpu attention and matmuls on TPU, as `serve` takes)
  the engine's own mesh (engine/build.engine_mesh) over those devices, the engine config's own
      scheduler config, and the real ModelRunner over the abstract model: its `lower(T)` is the
      program `warmup` compiles for bucket T, so what compiles here is what `serve` compiles
  KV pool: sized as `serve` sizes it (kv_sizing.kv_pool_bytes: utilization x HBM - weights - an
      activation estimate), then again from the largest program's temporaries as the compiler
      measured them; the programs are compiled at the measured size
  per program: compile seconds, memory_analysis (arguments, outputs, aliases, temporaries),
      cost_analysis (FLOPs, bytes), the collectives and any cache / weight copy in its HLO
      (hlo_scan.py), a predicted step time (predict.py)
A model that does not fit the chips is a `DoesNotFit` naming what does not fit and by how much.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from pathlib import Path

import numpy as np

from jaxserve.aot import hlo_scan, predict, ptxas_report
from jaxserve.aot.targets import GiB, Target
from jaxserve.config import ConfigError, EngineConfig, LoadConfig, ModelConfig, resolve_dtype
from jaxserve.config_engine import QuantizeSpec
from jaxserve.kv_sizing import activation_bytes, kv_pool_bytes

log = logging.getLogger("jaxserve.aot")

_HLO_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "s8", "uint8": "u8",
               "int32": "s32"}


class DoesNotFit(ValueError):
    """The model and its KV pool do not fit the target's chips; the message says by how much."""


class CompileFailed(ValueError):
    """The target's compiler refused a program: which one, and the compiler's first line."""


def _per_device_bytes(x) -> int:
    shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    return math.prod(shard) * np.dtype(x.dtype).itemsize


def _watched(tree) -> set[tuple[str, tuple[int, ...]]]:
    """(HLO dtype, per-device dims) of every array of `tree` of at least 1 MiB a chip."""
    import jax
    out = set()
    for x in jax.tree.leaves(tree):
        shard = tuple(x.sharding.shard_shape(x.shape))
        if math.prod(shard) * np.dtype(x.dtype).itemsize >= 2**20 and np.dtype(x.dtype).name in _HLO_DTYPES:
            out.add((_HLO_DTYPES[np.dtype(x.dtype).name], shard))
    return out


def allocator_bytes(target: Target) -> int:
    """What a chip's allocator gives the process, i.e. what memory_stats()["bytes_limit"] says
    on that machine (what `serve` sizes its pool from): a TPU's whole HBM; on a GPU, jax's
    preallocated share, XLA_PYTHON_CLIENT_MEM_FRACTION of it (0.75 unless set)."""
    if target.platform != "gpu":
        return target.chip.hbm_bytes
    return int(target.chip.hbm_bytes * float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")))


def read_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a folder's config.json (weights, if any, are not read)."""
    from checkpoints import CheckpointError
    from checkpoints.hf import read_hf_config
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"model: {folder} is not a folder holding a config.json")
    try:
        return read_hf_config(folder)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None


def _mesh(target: Target, tp: int):
    from jaxserve.engine.build import engine_mesh
    from sharding.mesh import make_mesh
    devices = list(target.devices)
    # One device still needs a mesh here: it is how the program learns which device it is for.
    return engine_mesh(tp, devices) or make_mesh(tp=1, devices=devices)


def _runner(model, config: EngineConfig, mesh):
    from jaxserve.engine.runner import ModelRunner
    sched = config.scheduler_config(model.cfg, np.dtype(model.dtype).itemsize)
    return ModelRunner(model, sched, config, mesh)


def _layer_iteration_costs(runner, T: int) -> tuple[float, float, int]:
    """(FLOPs, HBM bytes per chip, iterations) of one iteration of the decoder's layer scan in
    bucket T's step: the iteration's layers' weights read once and 2 FLOPs per weight per token
    (an MoE expert stack: top-k of its E experts per token, and at most T x top-k experts read).
    XLA's cost_analysis() counts a while loop's body once, whatever its trip count (the same
    figures for 2 layers as for 80), so the report adds the other iterations' share from this;
    attention's own FLOPs and KV reads are not in it (predict.py adds the KV read)."""
    import jax
    from flax import nnx

    from jaxserve.model import quant_linear as ql
    from jaxserve.model.decoder import scan_trips
    cfg = runner.model_cfg
    trips, period = scan_trips(cfg)
    L = cfg.num_layers
    flops = nbytes = 0.0
    for name, w in nnx.to_pure_dict(runner._state)["layers"].items():
        per_layer = sum(_per_device_bytes(x) for x in jax.tree.leaves(w)) / L
        if ql.is_quantized(w):
            elems = math.prod(w.q.sharding.shard_shape(w.q.shape)) * (8 // w.bits) / L
            matrix = True
        else:
            elems = math.prod(w.sharding.shard_shape(w.shape)) / L
            matrix = len(w.shape) >= 3  # [L, in.., out..]; norms and biases are [L, n]
        if name.startswith("we_") and cfg.num_experts:  # [L, E, ...]: top-k of E experts a token
            k, E = cfg.num_experts_per_tok, cfg.num_experts
            nbytes += per_layer * min(1.0, T * k / E)
            flops += 2 * T * elems * k / E
        else:
            nbytes += per_layer
            flops += 2 * T * elems if matrix else 0.0
    return flops * period, nbytes * period, trips


def _head_costs(runner, T: int) -> tuple[float, float]:
    """(FLOPs, bytes per chip) of bucket T's LM head over its logit rows (one per sequence)."""
    import jax
    from flax import nnx
    state = nnx.to_pure_dict(runner._state)
    w = state.get("lm_head", state["embed"])
    leaves = jax.tree.leaves(w)
    nbytes = sum(_per_device_bytes(x) for x in leaves)
    elems = math.prod(leaves[0].sharding.shard_shape(leaves[0].shape)) * (2 if leaves[0].dtype == np.uint8 else 1)
    rows = runner.seqs_for(T)
    return 2.0 * rows * elems, float(nbytes)


def _compile_one(runner, T: int, chip, aot_dir: Path | None, watched, dumps=None) -> dict:
    """`dumps` (GPU targets): a ptxas_report.Dumps, whose kernels' ptxas figures join the entry."""
    lowered = runner.lower(T)
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile(**({} if dumps is None else {"compiler_options": dumps.compiler_options()}))
    except Exception as e:  # the compiler's own verdict, in one line naming the program
        text = str(e).strip()
        first = next((ln for ln in text.splitlines() if ln.strip()), type(e).__name__)[:400]
        if "RESOURCE_EXHAUSTED" in text:
            raise DoesNotFit(f"the {T}-token step does not fit {chip.name}'s memory, by the compiler's measure: "
                             f"{first}") from None
        raise CompileFailed(f"the {T}-token step did not compile for {chip.name}: {first}") from None
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax: one dict per module
        cost = cost[0] if cost else {}
    compiler_flops, compiler_bytes = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    body_flops, body_bytes, trips = _layer_iteration_costs(runner, T)
    if cost:
        flops, nbytes = compiler_flops + (trips - 1) * body_flops, compiler_bytes + (trips - 1) * body_bytes
        source = "compiler + the layer scan's other iterations"
    else:  # XLA:GPU compiled without a device gives no cost analysis: the weights alone
        head_flops, head_bytes = _head_costs(runner, T)
        flops = trips * body_flops + head_flops
        nbytes = trips * body_bytes + head_bytes
        source = "analytic: layer and LM-head weights only (no cost_analysis from this compiler)"
    hlo = compiled.as_text()
    collectives, copies = hlo_scan.scan(hlo, watched)
    roof = predict.roofline(flops, nbytes, chip)
    entry = dict(
        name=f"step_T{T}", tokens=T, max_seqs=runner.seqs_for(T), compile_s=round(compile_s, 2),
        argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
        alias_bytes=mem.alias_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
        code_bytes=mem.generated_code_size_in_bytes,
        peak_bytes=(mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                    + mem.temp_size_in_bytes),
        flops=flops, bytes_accessed=nbytes, compiler_flops=compiler_flops, compiler_bytes_accessed=compiler_bytes,
        layer_scan_trips=trips, cost_source=source, predicted_s=roof.seconds, predicted_bound=roof.bound,
        compiler_optimal_s=cost.get("optimal_seconds"),
        collectives={k: dict(count=c.count, bytes=c.bytes, conditional=c.conditional)
                     for k, c in collectives.items()},
        copies=[dataclasses.asdict(c) for c in copies])
    if dumps is not None:
        entry["ptxas"] = ptxas_report.summarize(dumps.kernels(hlo))
    if aot_dir is not None:  # what `serve --aot-dir` loads instead of compiling (executable_store.py)
        from jaxserve.aot import executable_store
        entry["serialized_bytes"] = executable_store.save(aot_dir, runner, T, compiled)["serialized_bytes"]
    return entry


def compile_for(target: Target, model_path: str | Path, load: LoadConfig, config: EngineConfig, *,
                progress: bool = False, aot_dir: str | Path | None = None, contexts=(1024,)) -> dict:
    """Compile every step program `serve` warms up for these flags on `target`; the report
    (see the module docstring) as a JSON-ready dict. Raises DoesNotFit, ConfigError."""
    cfg = read_model_config(model_path)
    with contextlib.ExitStack() as stack:
        # On a GPU target every compile leaves its PTX and ptxas reports for the kernel table.
        dumps = stack.enter_context(ptxas_report.dumping()) if target.platform == "gpu" else None
        return _compile_for(target, model_path, cfg, load, config, progress, aot_dir, contexts, dumps)


def _compile_for(target: Target, model_path, cfg: ModelConfig, load: LoadConfig, config: EngineConfig,
                 progress: bool, aot_dir, contexts, dumps) -> dict:
    import jax.numpy as jnp
    from tqdm import tqdm

    from jaxserve.aot.abstract_model import abstract_model
    from sharding import backends

    dtype = resolve_dtype(load.dtype, target.platform)
    chip = target.chip
    util = config.gpu_memory_utilization
    memory = allocator_bytes(target)
    with backends.targeting(target.platform, target.devices):
        model = abstract_model(cfg, jnp.dtype(dtype), QuantizeSpec(load.quantize, load.quantize_group_size),
                               load.quant_impl)
        mesh = _mesh(target, config.tp)
        n_dev = mesh.devices.size
        # Weights per chip as the runner places them (KV heads replicated where tp needs it).
        probe = _runner(model, dataclasses.replace(config, num_pages=2, kv_cache_bytes=None), mesh)
        import jax
        weights = max(sum(_per_device_bytes(x) for x in jax.tree.leaves(probe._state)), 0)
        base = dict(topology=target.topology, chip=chip.name, platform=target.platform,
                    num_devices=target.num_devices, num_hosts=target.num_hosts, mesh_devices=n_dev,
                    tp=config.tp, dtype=dtype, quantize=load.quantize, kv_cache_dtype=config.kv_cache_dtype,
                    hbm_bytes_per_chip=chip.hbm_bytes, allocator_bytes_per_chip=memory,
                    gpu_memory_utilization=util,
                    weights_bytes_per_chip=weights, chip_source=chip.source,
                    parameters=sum(math.prod(x.shape) for x in jax.tree.leaves(nnx_state_float(model))))
        usable = int(util * memory)
        if weights >= usable:
            raise DoesNotFit(f"{Path(model_path).name} does not fit {target.topology} at tp={config.tp}: "
                             f"{weights / GiB:.2f} GiB of weights per chip, over {util} x "
                             f"{memory / GiB:.1f} GiB = {usable / GiB:.2f} GiB by "
                             f"{(weights - usable) / GiB:.2f} GiB")
        # serve's own sizing (build.size_kv_pool with these chips' numbers), then the compiler's.
        act = activation_bytes(config.max_num_batched_tokens, cfg.hidden_size, cfg.intermediate_size,
                               cfg.vocab_size)
        try:
            pool, why = kv_pool_bytes(target.platform, kv_cache_bytes=config.kv_cache_bytes, utilization=util,
                                      devices=[(memory, weights)] * n_dev, activations=act,
                                      num_kv_heads=cfg.num_kv_heads)
        except ConfigError as e:
            raise DoesNotFit(f"{Path(model_path).name} does not fit {target.topology} at tp={config.tp}: {e}") from None
        sized = config if config.num_pages is not None else dataclasses.replace(config, kv_cache_bytes=pool)
        runner = _runner(model, sized, mesh)
        serve_pages = runner.sched.num_pages
        buckets = sorted(runner.buckets, reverse=True)  # the largest first: its temporaries size the pool
        measure = config.num_pages is None and config.kv_cache_bytes is None
        out_dir = Path(aot_dir) if aot_dir is not None else None
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
        bar = tqdm(total=len(buckets), desc=f"compiling for {target.topology}", unit="program",
                   disable=not progress)
        sizing = why
        # Only a pool sized from the compiler's measure needs the sizing compile; a pool the flags
        # fix (num_pages, kv_cache_bytes) is compiled once, in the loop below.
        sizing_bytes = dict(sizing_temp_bytes=None, sizing_output_bytes=None)
        if measure:
            # The sizing compile runs at a small pool: a step's temporaries do not grow with the
            # pool (the cache is donated, in place), and serve's estimate, which fills the chip,
            # would leave the compiler no room for temporaries larger than the estimate.
            runner = _runner(model, dataclasses.replace(config, num_pages=runner.pages_per_seq + 2), mesh)
            first = _compile_one(runner, buckets[0], chip, None, set(), dumps)
            sizing_bytes = dict(sizing_temp_bytes=first["temp_bytes"],
                                sizing_output_bytes=first["output_bytes"] - first["alias_bytes"])
            # The pool from the compiler's measure: what is left per chip after the weights and
            # the largest program's temporaries and non-aliased outputs.
            left = usable - weights - sizing_bytes["sizing_temp_bytes"] - sizing_bytes["sizing_output_bytes"]
            page_per_chip = sum(_per_device_bytes(x) for x in jax.tree.leaves(runner.cache)) / runner.sched.num_pages
            if left < 2 * page_per_chip:
                raise DoesNotFit(
                    f"{Path(model_path).name} does not fit {target.topology} at tp={config.tp}: {weights / GiB:.2f} "
                    f"GiB of weights + {first['temp_bytes'] / GiB:.2f} GiB of temporaries (the {buckets[0]}-token "
                    f"step, compiled) per chip leave {left / GiB:.2f} GiB of {usable / GiB:.2f} GiB for the KV "
                    f"cache; lower max_num_batched_tokens, raise tp or quantize")
            measured = int(left // page_per_chip)
            runner = _runner(model, dataclasses.replace(config, num_pages=measured), mesh)
            sizing = (f"{util} x {memory / GiB:.1f} GiB - {weights / GiB:.2f} GiB weights - "
                      f"{(usable - weights - left) / GiB:.2f} GiB temporaries and outputs of the largest step "
                      f"(compiled) per chip; serve's estimate was {serve_pages} pages ({why})")
        watched = _watched((runner._state, runner.cache))
        programs = []
        for T in buckets:
            programs.append(_compile_one(runner, T, chip, out_dir, watched, dumps))
            log.info("compiled the %d-token step in %.1f s", T, programs[-1]["compile_s"])
            bar.update(1)
        bar.close()
        kv_per_chip = sum(_per_device_bytes(x) for x in jax.tree.leaves(runner.cache))
    sched = runner.sched
    peak = max(p["peak_bytes"] for p in programs)
    fits = peak <= memory
    max_len = sched.max_model_len
    pages_per_seq = -(-max_len // sched.page_size)
    tokens_per_chip_kv = kv_per_chip / max(sched.num_usable_pages * sched.page_size, 1)
    report = dict(base, **sizing_bytes, kv_bytes_per_chip=kv_per_chip, num_pages=sched.num_usable_pages,
                  page_size=sched.page_size, kv_tokens=sched.num_usable_pages * sched.page_size,
                  max_model_len=max_len, max_num_seqs=sched.max_num_seqs,
                  concurrent_seqs_at_max_len=sched.num_usable_pages // pages_per_seq,
                  kv_sizing=sizing, peak_bytes_per_chip=peak, fits=fits,
                  compile_s_total=round(sum(p["compile_s"] for p in programs), 1),
                  programs=sorted(programs, key=lambda p: p["tokens"]))
    report["predicted"] = _predictions(report, tokens_per_chip_kv, contexts)
    if not fits:
        raise DoesNotFit(f"{Path(model_path).name} does not fit {target.topology} at tp={config.tp}: the "
                         f"largest program needs {peak / GiB:.2f} GiB per chip, over "
                         f"{memory / GiB:.1f} GiB by {(peak - memory) / GiB:.2f} GiB")
    return report


def nnx_state_float(model):
    """The model's parameters as their float shapes (a QuantizedWeight counts its full shape)."""
    import jax
    from flax import nnx

    from jaxserve.model import quant_linear as ql
    leaves = jax.tree.leaves(nnx.state(model), is_leaf=ql.is_quantized)
    return [jax.ShapeDtypeStruct(x.full_shape, np.float32) if ql.is_quantized(x) else x for x in leaves]


def _predictions(report: dict, kv_bytes_per_token: float, contexts) -> dict:
    from jaxserve.aot.targets import CHIPS
    chip = CHIPS[report["chip"]]
    out = {"label": "predicted from the compiled programs' counts and the chip's published peaks; nothing ran",
           "decode_tokens_per_s": [], "prefill_tokens_per_s": None}
    for context in contexts:
        for batch in (1, 8, 64, 256):
            got = predict.decode_tokens_per_s(report["programs"], batch, context, kv_bytes_per_token, chip)
            if got is not None:
                out["decode_tokens_per_s"].append(dict(batch=batch, context=context, bucket=got[1],
                                                       tokens_per_s=round(got[0], 1)))
    tps, bucket = predict.prefill_tokens_per_s(report["programs"], chip)
    out["prefill_tokens_per_s"] = dict(bucket=bucket, tokens_per_s=round(tps, 1))
    return out


def format_table(report: dict) -> str:
    """The report as the text `jaxserve compile` prints."""
    g = GiB
    lines = [f"{report['topology']}: {report['num_devices']} x {report['chip']} ({report['num_hosts']} host(s)), "
             f"engine on {report['mesh_devices']} chip(s) at tp={report['tp']}, {report['dtype']}, "
             f"weights {report['quantize']}, KV {report['kv_cache_dtype']}",
             f"per chip: HBM {report['hbm_bytes_per_chip'] / g:.1f} GiB, weights {report['weights_bytes_per_chip'] / g:.2f} "
             f"GiB, KV {report['kv_bytes_per_chip'] / g:.2f} GiB, peak {report['peak_bytes_per_chip'] / g:.2f} GiB: "
             f"{'fits' if report['fits'] else 'DOES NOT FIT'}",
             f"KV pool: {report['num_pages']} pages x {report['page_size']} = {report['kv_tokens']} tokens; "
             f"{report['concurrent_seqs_at_max_len']} sequences at max_model_len {report['max_model_len']} "
             f"({report['kv_sizing']})",
             "",
             f"{'program':<12} {'compile s':>9} {'args GiB':>9} {'temp GiB':>9} {'out GiB':>8} {'GFLOP':>10} "
             f"{'GB read':>9} {'pred. ms':>9} {'bound':>7}  collectives"]
    for p in report["programs"]:
        coll = ", ".join(f"{k} x{v['count']}" + (f" (+{v['conditional']} in branches)" if v["conditional"] else "")
                         for k, v in p["collectives"].items()) or "-"
        if p["copies"]:
            coll += "; COPIES: " + ", ".join(f"{c['opcode']} {c['shape']} x{c['count']}"
                                             + (" in a cond branch" if c["conditional"] else "") for c in p["copies"])
        lines.append(f"{p['name']:<12} {p['compile_s']:>9.1f} {p['argument_bytes'] / g:>9.2f} {p['temp_bytes'] / g:>9.3f} "
                     f"{(p['output_bytes'] - p['alias_bytes']) / g:>8.3f} {p['flops'] / 1e9:>10.1f} "
                     f"{p['bytes_accessed'] / 1e9:>9.2f} {p['predicted_s'] * 1e3:>9.2f} {p['predicted_bound']:>7}  {coll}")
    pr = report["predicted"]
    lines.append("")
    lines.append(f"compile total {report['compile_s_total']:.1f} s; predicted (nothing ran): " +
                 "; ".join(f"decode B={d['batch']} @ {d['context']} ctx {d['tokens_per_s']:.0f} tok/s"
                           for d in pr["decode_tokens_per_s"]) +
                 f"; prefill {pr['prefill_tokens_per_s']['tokens_per_s']:.0f} tok/s")
    if any("ptxas" in p for p in report["programs"]):
        lines += ptxas_report.format_kernels(report["programs"])
    return "\n".join(lines)
