"""Turns a scheduler StepPlan into fixed-shape device arrays and runs one compiled step.

Layout of a step (one flat ragged batch, padded to a token bucket T; S = min(T, max_num_seqs)):
  tokens, positions, slot_mapping, token_seq   [T]   every scheduled token, sequence after
                                                     sequence; padding has position -1
  block_tables                                  [S, pages_per_seq]   row i = plan.seqs[i]
  logit_index                                   [R]   logit slots: flat index of a token whose
                                                     logits are sampled. Slot i < S is row i's
                                                     last token before any drafts.
                                                     Without speculation R = S; with k draft
                                                     tokens R = S + min(T - 1, S * k) and the
                                                     draft tokens' slots follow from S on (their
                                                     LM head runs only in steps that have drafts)
  slot_row, slot_pos                            [R]   each slot's row and position in its run:
                                                     the step verifies drafts on device by the
                                                     rejection rule (model/rejection_sampler.py)
  sampling / penalties                          [S]   per-row settings (see model.sampler)
  allowed, has_mask                             [S, ceil(V/32)]  structured outputs' token
                                                     bitmask (engine/grammar.py); all ones and
                                                     skipped when no row is constrained
  bias, has_bias                                [S, MAX_LOGIT_BIAS]  logit_bias as (token id,
                                                     value) pairs padded with id V (dropped);
                                                     skipped when no row has a bias
  prompt_targets, want_prompt_lp                [T]   prompt_logprobs: for each token whose next
                                                     token is a prompt token of a row that asks,
                                                     that token's id (else -1); every position's
                                                     logits are projected only in steps with one
Every bucket is compiled ahead of time in `warmup` (with a progress bar, into the persistent
compilation cache when one is configured); `execute` never compiles, and raises if a plan
needs a shape outside the buckets. The KV cache is donated to each call and lives on device.

A model whose weights are all jax.ShapeDtypeStructs (jaxserve/aot/abstract_model.py) makes an
abstract runner: parameters and cache are shapes with shardings over the mesh's devices (which
may be compile-only devices of a TPU or GPU topology), nothing is placed, and `lower(T)` gives
the very programs `warmup` compiles, for `jaxserve compile` to compile for another machine.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import host_malloc, huge_pages
from jaxserve.config import ConfigError, EngineConfig, SchedulerConfig
from jaxserve.engine import compile_watch, kv_pages, self_draft, step_program
from jaxserve.model import quant_linear as ql
from jaxserve.model.decoder import unpack_float_weights
from jaxserve.model.llama import KVCache, Llama, param_axes, param_shapes, replicate_kv_heads
from jaxserve.model.paged_attention import GroupedKV, init_paged_cache, make_paged_attend
from jaxserve.engine.step_arrays import RowInfo, StepArrays, StepInputs, sampling_arrays  # noqa: F401  (re-exported)
from jaxserve.scheduler.plan import StepPlan
from sharding import rules

log = logging.getLogger("jaxserve.engine")



class StepResult(NamedTuple):
    """Per logit slot (see the module doc); slots beyond the plan's are padding."""

    tokens: np.ndarray  # [R] sampled ids
    logprob: np.ndarray  # [R] of the sampled token
    top_ids: np.ndarray  # [R, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # [R, MAX_LOGPROBS]
    # Per plan row, its slots in order (the token after its run, then after each draft).
    row_slots: tuple[tuple[int, ...], ...]
    # Per flat token of the step (prompt_logprobs; None from runners without them): the
    # logprob of its prompt_targets entry, and the top MAX_LOGPROBS at that position.
    prompt_logprob: np.ndarray | None = None  # [T]
    prompt_top_ids: np.ndarray | None = None  # [T, MAX_LOGPROBS]
    prompt_top_logprobs: np.ndarray | None = None  # [T, MAX_LOGPROBS]
    # Per plan row: how many of its drafts the step kept (rejection_sampler.verify_slots), so
    # its tokens are those drafts and the token in its slot after them. None from runners that
    # verify greedily only: the engine then keeps drafts while they equal the slots' tokens.
    accepted: np.ndarray | None = None  # [S]
    # Seq id -> the tokens a draft model put in its draft slots (the plan had placeholders:
    # Scheduler.fill_drafts); None with n-gram drafts, which the plan already holds.
    drafts: dict[int, tuple[int, ...]] | None = None



class ModelRunner:
    """The real Runner (engine/runner_protocol.py). With a mesh (tensor parallelism), parameters and the KV cache are split over its "tp"
    axis by sharding.rules, attention runs per head shard under shard_map, and the step is
    jitted with explicit in/out shardings; step inputs and sampled tokens are replicated."""

    def __init__(self, model: Llama, sched: SchedulerConfig, cfg: EngineConfig, mesh=None, draft_model=None):
        self.sched = sched
        self.cfg = cfg
        self.mesh = mesh
        self.buckets = cfg.buckets()
        ps, chunk = sched.page_size, cfg.kv_chunk_pages
        pages = -(-sched.max_model_len // ps)
        self.pages_per_seq = -(-pages // chunk) * chunk
        self.spec_k = sched.num_speculative_tokens
        attend = make_paged_attend(model.cfg, chunk, cfg.attention_impl, page_size=ps, dtype=model.dtype,
                                   kv_cache_dtype=cfg.kv_cache_dtype, max_decode_run=1 + self.spec_k)
        # int8 scales in the layout this attention reads (lane-dense for the TPU kernel).
        self._lane_dense_scales = attend.lane_dense_scales
        self.abstract = _is_abstract(model)
        if self.abstract and mesh is None:
            raise ValueError("an abstract model (no weights) needs a mesh to say which devices it compiles for")
        if mesh is not None:
            tp = mesh.shape["tp"]
            copies = rules.kv_replication(model.cfg.num_heads, model.cfg.num_kv_heads, tp)
            if self.abstract and copies > 1:  # the same function, traced for its shapes only
                model = nnx.eval_shape(lambda m: replicate_kv_heads(m, copies), model)
            else:
                model = replicate_kv_heads(model, copies)
            # Place a copy: the caller's model (shared by tests, or a single-device engine)
            # must stay where it is. nnx.clone makes new variables (nnx.merge of a split
            # would hand back the same ones); the arrays are shared until placed.
            model = nnx.clone(model)
            unpack_float_weights(model)  # a model loaded for one CPU device may hold packed weights
            self._place_params(model, mesh)
            if model.quantized_matmul is not None:  # split weights run per shard, on this mesh
                model.quantized_matmul = model.quantized_matmul.on_mesh(mesh)
            if getattr(model, "grouped_matmul", None) is not None:  # MoE experts split over "tp" run per shard
                model.grouped_matmul = model.grouped_matmul.on_mesh(mesh)
            attend = rules.shard_attend(attend, mesh)
        self.model_cfg = model.cfg  # with replicated KV heads when tp needs them
        self._attend = attend
        self._graphdef, self._state = nnx.split(model)
        self._cache_model = model  # what reset_cache needs (its cfg and dtype)
        self.cache: KVCache | GroupedKV = self._new_cache(model, sched, ps)
        self._executables: dict[int, object] = {}
        self.aot_loaded: list[int] = []  # buckets whose step came from cfg.aot_dir, not the compiler
        # The step's host arrays (step_arrays.py); its bucket arithmetic is the runner's too.
        self.sliding = sched.sliding_window is not None  # two KV groups (model/paged_attention.py)
        self.arrays = StepArrays(self.buckets, sched.max_num_seqs, ps, self.pages_per_seq, self.spec_k,
                                 sched.max_model_len, model.cfg.vocab_size, sliding=self.sliding)
        self.mask_words = self.arrays.mask_words
        self.seqs_for = self.arrays.seqs_for
        self.logit_slots_for = self.arrays.logit_slots_for
        self.bucket_for = self.arrays.bucket_for
        self.build_inputs = self.arrays.build_inputs
        self.check_row = self.arrays.check_row
        self.compile_s = 0.0
        self.step_fn = step_program.make_step_fn(self._graphdef, attend)  # the program every bucket compiles
        # Draft models (engine/self_draft.py): a draft program per bucket runs before the step,
        # the target's first layers on its own cache, or a draft model of its own on its cache.
        self.draft_layers = sched.speculative_layers
        self.own_draft = draft_model is not None
        self.draft_cache = None
        self._draft_executables: dict[int, object] = {}
        self._no_draft_q: dict[int, jax.Array] = {}
        if self.draft_layers:
            self_draft.check(self.draft_layers, model.cfg.num_layers, self.sliding)
            self._draft_fn = self_draft.make_draft_fn(self._graphdef, attend, self.draft_layers, self.spec_k, ps)
        elif self.own_draft:
            if mesh is not None:
                raise ConfigError("speculative_model: a draft model of its own runs without a mesh (tp 1) for now")
            draft_attend = make_paged_attend(draft_model.cfg, chunk, cfg.attention_impl, page_size=ps,
                                             dtype=draft_model.dtype, kv_cache_dtype=cfg.kv_cache_dtype,
                                             max_decode_run=1 + self.spec_k)
            self._draft_graphdef, self._draft_state = nnx.split(draft_model)
            self._draft_model = draft_model
            self.draft_cache = self._new_cache(draft_model, sched, ps)
            self._draft_fn = self_draft.make_draft_fn(self._draft_graphdef, draft_attend, None, self.spec_k, ps,
                                                      own_cache=True)
        self.drafting = bool(self.draft_layers) or self.own_draft
        self._huge_pages: huge_pages.InBackground | None = None
        self._back_with_huge_pages()

    @staticmethod
    def _place_params(model: Llama, mesh) -> None:
        """Every parameter put on the mesh as sharding.rules says; a QuantizedWeight's arrays by
        rules.quantized_spec, which also picks how its matmul splits (or refuses, naming tp).
        Abstract parameters get the same shardings, nothing moved."""
        axes, shapes = param_axes(model.cfg), param_shapes(model.cfg)
        shardings = rules.param_shardings(axes, shapes, mesh)
        for path, sharding in shardings.items():
            owner = model
            *parents, leaf = path.split(".")
            for p in parents:
                owner = getattr(owner, p)
            var = getattr(owner, leaf)
            value = var.get_value()  # not var[...]: an abstract weight cannot be indexed
            if ql.is_quantized(value):
                spec, split = rules.quantized_spec(path, axes[path], shapes[path], len(value.lead_shape),
                                                   value.in_axes, value.group_size, mesh)
                var.set_value(value.placed(jax.sharding.NamedSharding(mesh, spec), split))
            elif isinstance(value, jax.ShapeDtypeStruct):
                var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))
            else:
                var.set_value(jax.device_put(value, sharding))

    def _back_with_huge_pages(self) -> None:
        """On CPU, the buffers this runner keeps (weights, KV caches) moved onto 2 MiB pages in
        the background (jaxserve/huge_pages.py); warmup says how that went. Again after
        reset_cache: pages already huge cost nothing, and the report covers the live cache."""
        if self.cfg.host_huge_pages and not self.abstract:
            job = huge_pages.InBackground((self._state, self.cache, getattr(self, "_draft_state", None),
                                           self.draft_cache))
            self._huge_pages = job if job.ranges else None

    def huge_pages_report(self) -> huge_pages.HugePages | None:
        """What the background request did (waits for it); None where none was made."""
        return None if self._huge_pages is None else self._huge_pages.result()

    def _new_cache(self, model: Llama, sched: SchedulerConfig, ps: int) -> KVCache | GroupedKV:
        def make():  # one KVCache, or a GroupedKV for a two-group model's full and sliding layers
            return init_paged_cache(model.cfg, sched.num_pages, ps, model.dtype, self.cfg.kv_cache_dtype,
                                    num_sliding_pages=sched.num_sliding_pages,
                                    lane_dense_scales=self._lane_dense_scales,
                                    shards=1 if self.mesh is None else self.mesh.shape["tp"])
        if self.mesh is None:
            return make()
        # Built directly in its sharded layout: no device ever holds the whole cache.
        shapes = jax.eval_shape(make)
        out = jax.tree.map(lambda spec: jax.sharding.NamedSharding(self.mesh, spec), rules.cache_specs(shapes),
                           is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        if self.abstract:
            return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, out)
        return jax.jit(make, out_shardings=out)()

    # ---- compilation ---------------------------------------------------------------------

    def _draft_q_shape(self, T: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.seqs_for(T), self.spec_k, self.model_cfg.vocab_size), jnp.float32)

    def lower(self, T: int, draft: bool = False):
        """Bucket T's step program, lowered (jax.stages.Lowered): `warmup` compiles it, and
        `jaxserve compile` compiles it for another machine's devices. draft: the bucket's
        self-speculative draft program instead (engine/self_draft.py)."""
        fn = self._draft_fn if draft else self.step_fn
        state, cache = self._state, self.cache
        if draft and self.own_draft:
            state, cache = self._draft_state, self.draft_cache
        cache_abs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), cache)
        args = (state, cache_abs, self.arrays.abstract_inputs(T))
        if self.drafting and not draft:
            args += (self._draft_q_shape(T),)  # the draft's q, an input of every step
        if self.mesh is None:
            jitted = jax.jit(fn, donate_argnums=(1,))
        else:
            rep = rules.replicated(self.mesh)
            state_sh = jax.tree.map(lambda x: x.sharding, self._state)
            cache_sh = jax.tree.map(lambda x: x.sharding, self.cache)
            jitted = jax.jit(fn, donate_argnums=(1,), in_shardings=(state_sh, cache_sh, *[rep] * (len(args) - 2)),
                             out_shardings=(cache_sh, rep, rep) if draft else (cache_sh, rep))
        if not self.abstract:
            return jitted.lower(*args)
        # Compile-only devices: Pallas asks the abstract mesh which chip it lowers for (the
        # default backend, the CPU here, would answer for itself).
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            return jitted.lower(*args)

    def _compile(self, T: int):
        if self.cfg.aot_dir:  # an executable serialized ahead of time for exactly this program
            from jaxserve.aot import executable_store
            exe = executable_store.load(self.cfg.aot_dir, self, T)
            if exe is not None:
                self.aot_loaded.append(T)
                return exe
        return self.lower(T).compile()

    def warmup(self, progress: bool = True) -> float:
        """Compile every bucket ahead of time; returns the seconds it took. With a persistent
        compilation cache directory, a restart loads the executables instead of compiling."""
        from tqdm import tqdm
        if self.cfg.compilation_cache_dir:
            enable_compilation_cache(self.cfg.compilation_cache_dir)
        t0 = time.perf_counter()
        todo = [T for T in self.buckets if T not in self._executables]
        for T in tqdm(todo, desc="compiling step buckets", unit="bucket", disable=not progress):
            self._executables[T] = self._compile(T)
            if self.drafting:
                self._draft_executables[T] = self.lower(T, draft=True).compile()
        report = self.huge_pages_report()
        if report is not None:
            log.info("%s", report.describe("weights and KV cache"))
        if self.cfg.host_reuse_step_memory and not self.abstract and self._on_cpu():
            log.info("%s", host_malloc.keep_step_memory(self._largest_step_block()))
        if self.cfg.aot_dir:
            log.info("aot_dir %s: %d of %d step programs loaded, the rest compiled", self.cfg.aot_dir,
                     len(self.aot_loaded), len(self.buckets))
        self.compile_s += time.perf_counter() - t0
        return time.perf_counter() - t0

    def _on_cpu(self) -> bool:
        return all(d.platform == "cpu" for d in jax.tree.leaves(self.cache)[0].devices())

    def _largest_step_block(self) -> int:
        """Bytes of the largest temporaries block any step or draft program mallocs per run."""
        exes = list(self._executables.values()) + list(self._draft_executables.values())
        return max((exe.memory_analysis().temp_size_in_bytes for exe in exes), default=0)

    def warmup_pages(self) -> float:
        """Run the page read and write programs (engine/kv_pages.py) once per page-count bucket
        a handover can need (n samples, each up to a full context), on the null page only, so a
        prefill or decode engine compiles nothing while serving."""
        t0 = time.perf_counter()
        most = kv_pages.bucket(self.pages_per_seq * self.sched.max_num_seqs)
        b = 1
        while b <= most:
            null = [0] * b
            self.write_pages(null, null if self.sliding else (), self.read_pages(null, null if self.sliding else ()))
            b *= 2
        jax.block_until_ready(self.cache)
        self.compile_s += time.perf_counter() - t0
        return time.perf_counter() - t0

    # ---- one step ------------------------------------------------------------------------

    def cache_intact(self) -> bool:
        """False once a failed call consumed the donated cache."""
        return not any(x.is_deleted() for x in jax.tree.leaves((self.cache, self.draft_cache)))

    def reset_cache(self) -> None:
        """A new, empty KV cache (after a failed step lost the old one)."""
        self.cache = self._new_cache(self._cache_model, self.sched, self.sched.page_size)
        if self.own_draft:  # its KV is only valid alongside the target's
            self.draft_cache = self._new_cache(self._draft_model, self.sched, self.sched.page_size)
        self._back_with_huge_pages()

    def read_pages(self, full_pages, sliding_pages=()) -> tuple:
        """These pages of the cache (and of a draft model's own cache), as stored
        (engine/kv_pages.py): what a prefill engine hands over."""
        caches = (self.cache,) if self.draft_cache is None else (self.cache, self.draft_cache)
        return tuple(kv_pages.read(c, full_pages, sliding_pages) for c in caches)

    def write_pages(self, full_pages, sliding_pages, data: tuple) -> None:
        """`read_pages`' data (from another engine of the same model and cache format) into
        these pages."""
        if len(data) != (1 if self.draft_cache is None else 2):
            raise ValueError(f"KV data for {len(data)} caches, this engine has "
                             f"{1 if self.draft_cache is None else 2} (a draft model's own cache counts)")
        self.cache = kv_pages.write(self.cache, full_pages, sliding_pages, data[0])
        if self.draft_cache is not None:
            self.draft_cache = kv_pages.write(self.draft_cache, full_pages, sliding_pages, data[1])

    def page_specs(self, num_full: int, num_sliding: int = 0) -> tuple:
        caches = (self.cache,) if self.draft_cache is None else (self.cache, self.draft_cache)
        return tuple(kv_pages.specs(c, num_full, num_sliding) for c in caches)

    def forget(self, seq_ids) -> None:
        """Nothing to drop: every step's inputs come whole from the plan (runner_protocol.py)."""

    def execute(self, plan: StepPlan, rows: Sequence[RowInfo]) -> StepResult:
        T, inputs, row_slots = self.build_inputs(plan, rows)
        exe = self._executables.get(T)
        if exe is None:
            raise compile_watch.CompilationAfterWarmup(
                f"bucket {T} was not compiled at warm-up (buckets: {self.buckets})")
        drafts, extra = None, ()
        if self.drafting:
            inputs, q, drafts = self._draft(T, plan, inputs, row_slots)
            extra = (q,)
        self.cache, out = exe(self._state, self.cache, self._placed(inputs), *extra)
        out = [_host(x) for x in out]
        return StepResult(*out[:4], row_slots=row_slots, prompt_logprob=out[4], prompt_top_ids=out[5],
                          prompt_top_logprobs=out[6], accepted=out[7], drafts=drafts)

    def _placed(self, inputs: StepInputs) -> StepInputs:
        if self.mesh is None:
            return inputs
        # Identical on every process (each runs the same scheduler on the same requests),
        # so each process supplies its copy of the replicated inputs, unchecked and unsent.
        rep = rules.replicated(self.mesh)
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(rep, np.asarray(x)), inputs)

    def _draft(self, T: int, plan: StepPlan, inputs: StepInputs, row_slots):
        """Run bucket T's draft program when the plan has draft slots, and every step for a draft
        model of its own (its cache must cover every token): (the inputs with the drafted
        tokens in those slots, the draft's q for the step, seq id -> its drafts), or (inputs,
        zeros, None) when nothing was drafted."""
        has_drafts = any(s.draft_len for s in plan.seqs)
        if not has_drafts and not self.own_draft:
            q = self._no_draft_q.get(T)
            if q is None:
                shape = self._draft_q_shape(T)
                zeros = np.zeros(shape.shape, shape.dtype)  # placed once: never sent again
                q = self._no_draft_q[T] = jax.device_put(zeros) if self.mesh is None else self._placed(zeros)
            return inputs, q, None
        exe = self._draft_executables.get(T)
        if exe is None:
            raise compile_watch.CompilationAfterWarmup(f"bucket {T}'s draft program was not compiled at warm-up")
        if self.own_draft:
            self.draft_cache, toks, q = exe(self._draft_state, self.draft_cache, inputs)
            if not has_drafts:
                return inputs, q, None
        else:
            self.cache, toks, q = exe(self._state, self.cache, self._placed(inputs))
        toks = _host(toks)
        tokens = np.array(inputs.tokens)
        drafts = {}
        for i, s in enumerate(plan.seqs):
            if s.draft_len:
                drafts[s.seq_id] = tuple(int(t) for t in toks[i, :s.draft_len])
                tokens[inputs.logit_index[list(row_slots[i][1:])]] = toks[i, :s.draft_len]
        return inputs._replace(tokens=tokens), q, drafts


def _is_abstract(model) -> bool:
    """True when every parameter is a ShapeDtypeStruct: a model built for compiling only."""
    leaves = jax.tree.leaves(nnx.state(model))
    return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def enable_compilation_cache(directory: str) -> None:
    import os
    path = os.path.abspath(os.path.expanduser(directory))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Cache every step executable, however fast it compiled (the defaults skip quick ones).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _host(x: jax.Array) -> np.ndarray:
    """A replicated result as numpy; across processes, read this process's own copy."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))
