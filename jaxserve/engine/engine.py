"""The engine loop: add requests, step, abort; what each step produced comes back as deltas.

    validate    -> the one request check (engine/request_check.py): form, size, tokenize with
                   the BOS rule, the scheduler's admission limits; the server calls it too
    add_request -> validate -> Scheduler.add_request (admission)
    step        -> Scheduler.schedule -> ModelRunner.execute -> Scheduler.update
                -> per sample: detokenize, stop strings, logprobs -> StepOutput deltas
                   (with speculative decoding a sample can gain several tokens in a step:
                   one delta per token, in order)
    abort       -> Scheduler.abort_request (pages freed at once) -> a final ABORT delta

Single-threaded: whoever owns the engine calls these from one thread (the server runs it on
its own engine thread and hands requests over through queues). Whenever the engine becomes
idle it checks reliability.md's "nothing lost" invariant: no page held (every page free, or
cached for prefix matches and reclaimable), every map empty.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine import compile_watch, faults, handover, request_check, self_draft
from jaxserve.engine.grammar import GrammarCompiler
from jaxserve.engine.prompt_logprobs import record as record_prompt_logprobs
from jaxserve.engine.runner import ModelRunner, RowInfo
from jaxserve.engine.runner_protocol import Runner, RunnerFactory, check_runner
from jaxserve.engine.sample_state import SampleState
from jaxserve.scheduler import Scheduler
from jaxserve.scheduler.admission import validate_request
from jaxserve.scheduler.speculation import accept
from jaxserve.scheduler.window import freeable_window
from jaxserve.tokenizer import Tokenizer
from jaxserve.types import (FinishReason, InvalidRequestError,
                            RequestMetrics, RequestOutput, SamplingParams, StepOutput)



@dataclasses.dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    metrics: RequestMetrics
    seed: int  # the request's seed as used: the caller's, or one derived from the base seed
    num_cached_tokens: int | None = None  # sample 0's prefix-cache hit at its first admission
    prompt_logprobs: list | None = None  # with params.prompt_logprobs (engine/prompt_logprobs.py)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids,
                             [s.completion() for s in self.samples], self.finished, self.metrics,
                             self.num_cached_tokens or 0, self.prompt_logprobs)


class Engine:
    """`model`: what the runner runs; the engine itself reads only `model.cfg` (a ModelConfig)
    and `model.dtype` (KV pool sizing). `runner`: a factory `(SchedulerConfig) -> Runner`
    (engine/runner_protocol.py); None builds the real ModelRunner over `model`."""

    def __init__(self, model, tokenizer: Tokenizer, config: EngineConfig | None = None,
                 eos_token_ids: tuple[int, ...] = (), mesh=None, runner: RunnerFactory | None = None,
                 draft_model=None):
        """draft_model: a model of the target's vocabulary that drafts num_speculative_tokens
        tokens a step from its own KV cache (engine/self_draft.py), on the target's pages."""
        self.config = config or EngineConfig()
        self.model_config = model.cfg
        self.model_dtype = str(np.dtype(model.dtype))
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.scheduler_config = self.config.scheduler_config(model.cfg, np.dtype(model.dtype).itemsize)
        if draft_model is not None:
            self.scheduler_config = self_draft.pool_with_draft(self.config, self.scheduler_config, model, draft_model)
        # Every layer windowed (Mistral): pages behind the window go back to the pool (window.py).
        self.scheduler = Scheduler(self.scheduler_config, kv_window=freeable_window(model.cfg))
        from jaxserve.engine.build import check_mesh, engine_mesh
        if mesh is None:
            mesh = engine_mesh(self.config.tp)
        check_mesh(mesh, self.config.tp)
        self.mesh = mesh
        if runner is None:
            def runner(sched, model=model, config=self.config, mesh=mesh):
                return ModelRunner(model, sched, config, mesh, draft_model=draft_model)
        self.runner: Runner = check_runner(runner(self.scheduler_config))
        self.grammar = GrammarCompiler(tokenizer, model.cfg.vocab_size, self.eos_token_ids)
        self._requests: dict[str, RequestState] = {}
        self._by_seq: dict[int, tuple[RequestState, SampleState]] = {}
        self._pending: list[StepOutput] = []
        self.finished_outputs: dict[str, RequestOutput] = {}  # until the caller pops them
        # Prefill role (engine/handover.py): requests to hand over once they have sampled, with
        # their priority and tenant, and the handovers made, until the caller pops them.
        self._to_hand_over: dict[str, tuple[int, str]] = {}
        self.handovers: dict[str, tuple[handover.Handover, tuple]] = {}
        self._ids = itertools.count()
        self._seed_counter = itertools.count()
        self._base_seed = self._agree_on_base_seed(self.config.seed)
        self.compiles_at_warmup: int | None = None
        self.strict_compiles = False  # tests set this: any compilation after warm-up raises
        self.stats = {"steps": 0, "computed_tokens": 0, "padded_tokens": 0, "preemptions": 0,
                      "draft_tokens": 0, "accepted_draft_tokens": 0, "drafts": 0, "step_faults": 0}
        # Speculative decoding per draft position i (vLLM's num_accepted_tokens_per_pos): runs
        # that drafted a token at position i, and runs that kept it.
        k = self.scheduler_config.num_speculative_tokens
        self.spec_positions = {"drafted": [0] * k, "accepted": [0] * k}
        self.consecutive_step_faults = 0  # faults since the last step that ran (engine/faults.py)
        self.last_step_fault: str | None = None

    @staticmethod
    def _agree_on_base_seed(seed: int | None) -> int:
        """Seeds of unseeded requests come from one base seed. Under multi-process tensor
        parallelism every process must draw the same ones (their step inputs must agree), so
        process 0's random base is broadcast to all."""
        if seed is not None:
            return seed
        base = _derive_seed(int(np.random.SeedSequence().entropy % 2**62), 0)
        import jax
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            # jax arrays are 32-bit here (x64 off): send the seed as two 31-bit halves.
            hi, lo = multihost_utils.broadcast_one_to_all(
                np.array([(base >> 31) & 0x7FFFFFFF, base & 0x7FFFFFFF], np.int32))
            base = (int(hi) << 31) | int(lo)
        return base

    # ---- lifecycle -----------------------------------------------------------------------

    def warmup(self, progress: bool = True, handover: bool = False) -> float:
        """Compile every step program; with `handover` (a prefill or decode engine) the KV page
        read and write programs too (engine/kv_pages.py)."""
        compile_watch.install()
        seconds = self.runner.warmup(progress)
        if handover:
            seconds += self.runner.warmup_pages()
        self.compiles_at_warmup = compile_watch.compiles()
        return seconds

    @property
    def compiles_after_warmup(self) -> int:
        return 0 if self.compiles_at_warmup is None else compile_watch.compiles() - self.compiles_at_warmup

    # ---- requests ------------------------------------------------------------------------

    def check_request(self, prompt: Any, params: SamplingParams | None = None) -> None:
        """The checks that need no tokenizing (engine/request_check.py): the prompt's form and
        size, token ids against the vocabulary, the params against the vocabulary."""
        request_check.check_prompt(prompt, self.model_config.vocab_size, self.scheduler_config.max_prompt_len)
        if params is not None:
            request_check.check_params(params, self.model_config.vocab_size)

    def validate(self, prompt: Any, params: SamplingParams | None = None, *, add_bos: bool | None = None,
                 fill_context: bool = False) -> request_check.ValidRequest:
        """The single request check, offline and in the server: a string, a list of chat
        messages or {"prompt_token_ids": [...]} with its params, refused with an
        InvalidRequestError naming the field and the limit, or returned as the ids and params
        add_request will run. `add_bos`: see request_check.tokenize (None: the model's BOS rule
        for text). `fill_context`: max_tokens becomes what the context has left. Reads fixed
        configuration only, so the server runs it on its tokenizer threads."""
        params = params if params is not None else SamplingParams()
        self.check_request(prompt, params)
        text, ids = request_check.tokenize(prompt, self.tokenizer, add_bos)
        if fill_context:
            params = request_check.fill_context(params, len(ids), self.scheduler_config)
        eos = () if params.ignore_eos else self.eos_token_ids
        validate_request(self.scheduler_config, "-", ids, params, eos, (), self.scheduler.kv_window)
        return request_check.ValidRequest(text, ids, params)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The model's chat template over `messages` (with the generation prompt)."""
        return request_check.render_chat(self.tokenizer, messages)

    def tokenize(self, prompt: Any, add_bos: bool | None = None) -> tuple[str | None, list[int]]:
        """(text, ids) of a prompt as the engine would run it (BOS rule included), no limits
        checked: for a caller that bounded the prompt already (the server's Tokenize calls)."""
        return request_check.tokenize(prompt, self.tokenizer, add_bos)

    def tokenize_prompt(self, prompt: Any) -> tuple[str | None, list[int]]:
        """`tokenize` after the prompt's form and size are checked."""
        self.check_request(prompt)
        return self.tokenize(prompt)

    def add_request(self, prompt: Any, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    drawn_seed: int | None = None, priority: int = 0, tenant: str = "",
                    hand_over: bool = False) -> str:
        """`drawn_seed`: the seed to use if `params` bring none, instead of drawing one (a
        multi-process replay uses process 0's draw, engine/lockstep.py). `priority` (lower
        first) and `tenant` feed the scheduling policy (scheduler/policy.py). `hand_over`: once
        every sample has its first token the request leaves this engine as a Handover under
        `handovers` (engine/handover.py), unless it finished already."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        valid = self.validate(prompt, params)
        text, ids, params = valid.text, valid.prompt_ids, valid.params
        if params.seed is not None:
            seed = params.seed
        elif drawn_seed is not None:
            seed = drawn_seed
        else:
            seed = _derive_seed(self._base_seed, next(self._seed_counter))
        # Structured outputs: one grammar matcher per sample, compiled before anything is
        # allocated (a bad schema is an InvalidRequestError naming the field).
        sop = params.structured_outputs
        matcher = self.grammar.matcher(sop) if sop is not None else None
        eos = () if params.ignore_eos else self.eos_token_ids
        seq_ids = self.scheduler.add_request(request_id, ids, params, eos, priority, tenant)
        metrics = RequestMetrics(arrival_time if arrival_time is not None else time.perf_counter())
        samples = [SampleState(request_id, i, seq_id, _sample_seed(seed, i), params, self.tokenizer, ids)
                   for i, seq_id in enumerate(seq_ids)]
        if matcher is not None:
            for i, smp in enumerate(samples):
                smp.matcher = matcher if i == 0 else matcher.deep_copy()
        req = RequestState(request_id, text, ids, params, samples, metrics, seed)
        self._requests[request_id] = req
        for s in samples:
            self._by_seq[s.seq_id] = (req, s)
        if hand_over:
            self._to_hand_over[request_id] = (priority, tenant)
        return request_id

    def import_request(self, h: handover.Handover, data: tuple, arrival_time: float | None = None) -> str:
        """Go on with a request another engine prefilled (engine/handover.py)."""
        return handover.import_request(self, h, data, arrival_time)

    def pop_handover(self, request_id: str) -> tuple[handover.Handover, tuple] | None:
        return self.handovers.pop(request_id, None)

    def abort_request(self, request_id: str) -> bool:
        """Ends the request now (pages freed in this call); its ABORT deltas come with the next step."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self.scheduler.abort_request(request_id)
        now = time.perf_counter()
        for s in req.samples:
            if s.finish_reason is None:
                self._pending.append(s.finish(FinishReason.ABORT))
        self._retire(req, now)
        return True

    def abort_all(self) -> list[str]:
        """End every request now (after a failure the owner cannot recover from): a plan left
        pending by a step that raised is discarded, every request's pages freed and its output
        dropped. Returns the request ids it ended."""
        self.scheduler.discard_pending_plan()
        ended = list(self._requests)
        for rid in ended:
            self.abort_request(rid)
            self.finished_outputs.pop(rid, None)
        self._pending.clear()
        return ended

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix (after a weight or adapter change); running requests
        keep their pages. Call it between steps, like add_request. Returns the cached pages freed."""
        return self.scheduler.reset_prefix_cache()

    def prefix_cache_stats(self) -> dict[str, int]:
        """Lookups and hits in tokens since start, cached pages now, evictions since start."""
        s = self.scheduler
        return {"queries": s.prefix_cache_queries, "hits": s.prefix_cache_hits,
                "cached_pages": s.num_cached_pages, "evictions": s.num_prefix_evictions}

    def get_request(self, request_id: str) -> RequestState | None:
        return self._requests.get(request_id)

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        out, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self.scheduler.discard_plan(plan)
            if not self.scheduler.has_unfinished():
                self._check_idle()
            return out
        compiles_before = compile_watch.compiles()
        rows, reqs = [], []
        for s in plan.seqs:
            req, sample = self._by_seq[s.seq_id]
            reqs.append(req)
            seq = self.scheduler.get_sequence(s.seq_id)
            allowed = draft_allowed = None
            if sample.matcher is not None and s.sample:
                allowed = np.empty(self.runner.mask_words, np.int32)
                self.grammar.fill(sample.matcher, allowed)
                if s.draft_len:
                    draft_allowed = self.grammar.draft_masks(sample.matcher, s.draft, allowed)
            if s.sample and len(seq.output_ids) < req.params.min_tokens:
                # min_tokens: EOS and the stop token ids are masked out until then (the same
                # on-device bitmask as structured outputs).
                if allowed is None:
                    allowed = np.full(self.runner.mask_words, -1, np.int32)
                bits = allowed.view(np.uint32)
                for t in (*self.eos_token_ids, *req.params.stop_token_ids):
                    bits[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
            rows.append(RowInfo(req.params, sample.seed, len(seq.output_ids), req.prompt_ids, seq.output_ids,
                                allowed, draft_allowed))
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.perf_counter()
            if sample.index == 0 and req.num_cached_tokens is None:
                req.num_cached_tokens = seq.num_cached_tokens
        try:
            result = self.runner.execute(plan, rows)
        except compile_watch.CompilationAfterWarmup:
            self.scheduler.discard_plan(plan)  # a test guard, not a fault: the caller must see it
            raise
        except Exception as e:
            self.scheduler.discard_plan(plan)  # the scheduler is as before the step
            return out + self._step_fault(plan, rows, e)
        except BaseException:
            self.scheduler.discard_plan(plan)
            raise
        self.consecutive_step_faults = 0
        if result.drafts:  # a draft model filled the plan's draft slots in the step
            plan = self.scheduler.fill_drafts(plan, result.drafts)
        record_prompt_logprobs(plan, result, reqs)
        if self.strict_compiles and compile_watch.compiles() != compiles_before:
            raise compile_watch.CompilationAfterWarmup(
                f"{compile_watch.compiles() - compiles_before} compilation(s) during step {self.stats['steps']}")
        T = self.runner.bucket_for(plan.num_tokens)
        self.stats["steps"] += 1
        self.stats["computed_tokens"] += T
        self.stats["padded_tokens"] += T - plan.num_tokens
        self.stats["preemptions"] += len(plan.preempted)

        slots_of = {s.seq_id: list(result.row_slots[i]) for i, s in enumerate(plan.seqs)}
        sampled = {}
        for i, s in enumerate(plan.seqs):
            if not s.sample:
                continue
            slots = slots_of[s.seq_id]
            if s.draft_len == 0:
                sampled[s.seq_id] = int(result.tokens[slots[0]])
            else:
                if result.accepted is not None:  # verified on device (rejection_sampler.verify_slots)
                    n = int(result.accepted[i])
                    kept = [*s.draft[:n], int(result.tokens[slots[n]])]
                else:  # a runner that verifies greedily: keep drafts while they equal its tokens
                    kept = accept(s.draft, [int(result.tokens[x]) for x in slots])
                sampled[s.seq_id] = kept
                self.stats["draft_tokens"] += s.draft_len
                self.stats["accepted_draft_tokens"] += len(kept) - 1
                self.stats["drafts"] += 1
                for j in range(s.draft_len):
                    self.spec_positions["drafted"][j] += 1
                    self.spec_positions["accepted"][j] += j < len(kept) - 1
        events = self.scheduler.update(plan, sampled)
        now = time.perf_counter()
        for ev in events:
            if ev.seq_id not in self._by_seq:
                continue  # a stop string ended this sample at an earlier token of the same step
            req, sample = self._by_seq[ev.seq_id]
            slot = slots_of[ev.seq_id].pop(0)  # a sequence's tokens come in order, one slot each
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            if sample.matcher is not None:
                sample.matcher.consume_token(ev.token_id)
            delta = sample.append(ev.token_id, result, slot,
                                  FinishReason(ev.finish_reason) if ev.finished else None)
            if sample.finish_reason is not None and not ev.finished:
                self.scheduler.finish_sequence(ev.seq_id, FinishReason.STOP)  # a stop string
            out.append(delta)
            if sample.finish_reason is not None:
                del self._by_seq[ev.seq_id]
            if req.finished:
                self._retire(req, now)
        for rid in list(self._to_hand_over):
            req = self._requests.get(rid)
            if req is None:  # finished (or aborted) before it could be handed over
                del self._to_hand_over[rid]
            elif handover.ready(self, req):
                handover.export(self, req, *self._to_hand_over.pop(rid))
        if not self.scheduler.has_unfinished():
            self._check_idle()
        return out

    def _step_fault(self, plan, rows: list[RowInfo], exc: Exception) -> list[StepOutput]:
        """engine/faults.py: fail the requests to blame (or the step's), keep serving the rest."""
        import logging
        cause = f"{type(exc).__name__}: {exc}"
        logging.getLogger("jaxserve.engine").error("engine step %d failed: %s", self.stats["steps"], cause,
                                                   exc_info=exc)
        self.stats["step_faults"] += 1
        self.consecutive_step_faults += 1
        self.last_step_fault = cause
        in_step: dict[str, RequestState] = {}
        blamed: dict[str, faults.Blame] = {}
        for s, row in zip(plan.seqs, rows):
            req = self._by_seq[s.seq_id][0]
            in_step[req.request_id] = req
            if req.request_id not in blamed:
                why = faults.blame_request(req.params, req.prompt_ids, self.model_config.vocab_size,
                                           lambda s=s, row=row: self.runner.check_row(s, row))
                if why is not None:
                    blamed[req.request_id] = why
        failed = blamed or {rid: faults.Blame(f"the engine step failed ({cause}); this request was "
                                              f"in that step, the others go on")
                            for rid in in_step}
        if not self.runner.cache_intact():
            try:
                self.runner.reset_cache()
            except Exception as e:
                raise faults.EngineBroken(f"the KV cache was lost in a failed step ({cause}) and a "
                                          f"new one cannot be made: {type(e).__name__}: {e}") from e
            # Cached prefix pages were in the lost cache too: a later match must not read them.
            self.scheduler.reset_prefix_cache()
            lost = faults.Blame(f"the KV cache was lost in a failed engine step ({cause}); retry")
            failed = {**{rid: lost for rid in self._requests}, **blamed}
        out = []
        now = time.perf_counter()
        for rid, why in failed.items():
            req = self._requests.get(rid)
            if req is None:
                continue
            self.scheduler.abort_request(rid)  # its pages are free again
            for sample in req.samples:
                if sample.finish_reason is None:
                    sample.error = why
                    out.append(sample.finish(FinishReason.ERROR))
            self._retire(req, now)
        if not self.scheduler.has_unfinished():
            self._check_idle()
        return out

    def _retire(self, req: RequestState, now: float) -> None:
        req.metrics.finished_time = now
        self._forget_request(req)
        self.finished_outputs[req.request_id] = req.output()

    def _forget_request(self, req: RequestState) -> None:
        self._requests.pop(req.request_id, None)
        self._to_hand_over.pop(req.request_id, None)
        for s in req.samples:
            self._by_seq.pop(s.seq_id, None)
        self.runner.forget([s.seq_id for s in req.samples])

    def pop_finished(self, request_id: str) -> RequestOutput | None:
        return self.finished_outputs.pop(request_id, None)

    def _check_idle(self) -> None:
        """reliability.md: at idle every page is free and every map is empty."""
        self.scheduler.check_idle_invariant()
        if self._requests or self._by_seq:
            from jaxserve.scheduler.errors import InvariantViolation
            raise InvariantViolation(f"engine idle but {len(self._requests)} requests / "
                                     f"{len(self._by_seq)} samples still tracked")

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verified run emitted on average (kept drafts plus the target's own token,
        vLLM's mean acceptance length); None before any draft."""
        d = self.stats["drafts"]
        return 1 + self.stats["accepted_draft_tokens"] / d if d else None

    @property
    def draft_acceptance(self) -> float | None:
        """Draft tokens kept / verified since start; None before any draft."""
        d = self.stats["draft_tokens"]
        return self.stats["accepted_draft_tokens"] / d if d else None

    @property
    def padding_fraction(self) -> float:
        c = self.stats["computed_tokens"]
        return self.stats["padded_tokens"] / c if c else 0.0


def _derive_seed(base: int, index: int) -> int:
    return int(np.random.SeedSequence([base, index]).generate_state(1, np.uint64)[0] >> 1)


def _sample_seed(seed: int, index: int) -> int:
    """Sample 0 uses the request's seed as given; sample i > 0 a seed derived from (seed, i)."""
    return seed if index == 0 else _derive_seed(seed, index)
