"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, named after vLLM's so
users' scripts port with little change.

    llm = jaxserve.LLM()                      # the embedded SmolLM2; or LLM("path", dtype="bfloat16")
    llm = jaxserve.LLM(quantize="as-shipped") # its own 4-bit blocks; or "int8" / "int4" (any model)
    outs = llm.generate(["Hello", [{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=32))
    outs[0].outputs[0].text, .token_ids, .finish_reason, .logprobs; outs[0].metrics.ttft

A prompt is a string, a list of chat messages, or {"prompt_token_ids": [...]}. Every prompt is
admitted before the first step, so continuous batching sees the whole workload at once.
Without sampling params a prompt gets `SamplingParams()`, vLLM's defaults: it samples at
temperature 1.0 (pass `SamplingParams(temperature=0)` for greedy output).

The server's scheduling policies work offline too, chosen when the LLM is built:

    llm = LLM(scheduling_policy="priority", max_num_seqs=8)
    llm.generate(prompts, params, priority=[1, 1, 0])        # lower first; preempts lower ones
    llm = LLM(fair_share=True, tenant_weights=(("a", 3.0),))
    llm.generate(prompts, params, tenant=["a", "b", "b"])    # step tokens shared 3 : 1
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as SequenceABC
from typing import Any, Sequence

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.config_engine import LIMIT_FIELDS
from jaxserve.engine.build import build_engine
from jaxserve.engine.speculative_config import translate as speculative_config_translate
from jaxserve.types import InvalidRequestError, RequestOutput, SamplingParams, check_priority


def _is_messages(p: Any) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(m, dict) and "role" in m for m in p)


def llm_configs(model: str | None = None, dtype: str = "auto", quantize: str = "none",
                quantize_group_size: int | None = None, quant_impl: str = "auto", matmul_impl: str = "auto",
                speculative_model: str | None = None, speculative_quantize: str = "none",
                engine_config: EngineConfig | None = None, speculative_config: dict | None = None,
                **engine_options: Any) -> tuple[LoadConfig, EngineConfig]:
    """LLM()'s keyword arguments (less `progress`) -> the config tree, every check run: what
    LLM builds from, and what a caller that builds LLMs elsewhere (jaxserve.ray's actors)
    checks first. TypeError for an unknown or doubled keyword, ConfigError for a refused value."""
    if speculative_config is not None:
        if engine_config is not None:
            raise TypeError("LLM() takes speculative_config with engine options as keywords, not with engine_config")
        load_fields, engine_fields = speculative_config_translate(speculative_config)
        both = sorted(set(engine_fields) & set(engine_options))
        if both or speculative_model is not None or speculative_quantize != "none":
            raise TypeError(f"LLM() got speculative_config and {both or 'speculative_model/quantize'} too")
        engine_options = {**engine_options, **engine_fields}
        speculative_model = load_fields.get("speculative_model")
        speculative_quantize = load_fields.get("speculative_quantize", "none")
    fields = {f.name for f in dataclasses.fields(EngineConfig)} | LIMIT_FIELDS
    unknown = sorted(set(engine_options) - fields)
    if unknown:
        raise TypeError(f"LLM() got unknown engine options {unknown}; known: {sorted(fields)}")
    if engine_config is not None and engine_options:
        raise TypeError("LLM() takes engine_config or engine options as keywords, not both")
    config = engine_config or EngineConfig(**engine_options)
    load = LoadConfig(model=None if model is None else str(model), dtype=dtype, quantize=quantize,
                      quantize_group_size=quantize_group_size, quant_impl=quant_impl,
                      matmul_impl=matmul_impl,
                      speculative_model=None if speculative_model is None else str(speculative_model),
                      speculative_quantize=speculative_quantize)
    return load, config


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", progress: bool = True,
                 quantize: str = "none", quantize_group_size: int | None = None, quant_impl: str = "auto",
                 matmul_impl: str = "auto", speculative_model: str | None = None, speculative_quantize: str = "none",
                 engine_config: EngineConfig | None = None, speculative_config: dict | None = None,
                 **engine_options: Any):
        """model, dtype, quantize, quantize_group_size, quant_impl, matmul_impl, speculative_model,
        speculative_quantize: the LoadConfig fields (the `--model`, `--dtype`, `--quantize` ... flags; dtype "auto" = bfloat16 on TPU/GPU,
        float32 on CPU). The engine: `engine_config`, or its fields as keywords (max_num_seqs=8,
        tp=2, ...; vLLM-style flat), not both. speculative_config: vLLM's dict
        (engine/speculative_config.py), instead of the speculative fields themselves."""
        load, config = llm_configs(model, dtype, quantize, quantize_group_size, quant_impl, matmul_impl,
                                   speculative_model, speculative_quantize, engine_config,
                                   speculative_config, **engine_options)
        # This process's own devices: in a multi-process job each process is its own replica
        # with its own prompts (scripts/generate_batch.py), so a mesh over the job's first
        # devices would leave every other process with none of its own.
        self.loaded, self.engine = build_engine(load, config, local_devices=True, progress=progress)
        self.warmup_s = self.engine.warmup(progress)
        self.tokenizer = self.loaded.tokenizer

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 tenant: str | Sequence[str] | None = None) -> list[RequestOutput]:
        """Run every prompt to its end; the outputs come in the prompts' order.

        `priority`: vLLM's, a list of ints, one per prompt, lower = served sooner. It needs the
        engine built with `scheduling_policy="priority"` (then a waiting request preempts
        lower-priority running ones, and `priority_aging_rate` bounds how long a low priority
        waits); a non-zero priority under any other policy is refused, as vLLM does.

        `tenant`: who each prompt is for, one str for all or a list of str, one per prompt
        (default: one anonymous tenant, ""). It needs `fair_share=True`: step tokens are then
        shared between the tenants, weighted by `tenant_weights`, as the server shares them
        between its callers. Offline it does not split the prefix cache (the server's tenants
        get one namespace each); use `SamplingParams(cache_salt=...)` for that.

        Both reach `Engine.add_request(priority=, tenant=)`, the server's own path, so they
        drive the same scheduler policy (jaxserve/scheduler/policy.py). Everything is checked
        before any prompt is added."""
        if isinstance(prompts, (str, dict)) or _is_messages(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        priorities = self._priorities(priority, len(prompts))
        tenants = self._tenants(tenant, len(prompts))
        ids = [self.engine.add_request(p, sp, priority=pr, tenant=t)
               for p, sp, pr, t in zip(prompts, params, priorities, tenants)]
        self.run_until_done(total_tokens=sum(sp.max_tokens * sp.n for sp in params), use_tqdm=use_tqdm)
        return [self.engine.pop_finished(i) for i in ids]

    def _priorities(self, priority: Sequence[int] | None, n: int) -> list[int]:
        if priority is None:
            return [0] * n
        if isinstance(priority, (str, bytes, dict)) or not isinstance(priority, SequenceABC):
            raise InvalidRequestError("priority", f"must be a list of ints, one per prompt, "
                                                  f"got {type(priority).__name__}")
        priority = list(priority)
        if len(priority) != n:
            raise InvalidRequestError("priority", f"has {len(priority)} entries for {n} prompts "
                                                  f"(one per prompt)")
        for i, p in enumerate(priority):
            check_priority(p, f"priority[{i}]")
        policy = self.engine.scheduler_config.scheduling_policy
        if policy != "priority" and any(priority):
            raise InvalidRequestError("priority", f"is ignored by scheduling_policy={policy!r}; build the "
                                                  f"LLM with scheduling_policy='priority' to use it")
        return priority

    def _tenants(self, tenant: str | Sequence[str] | None, n: int) -> list[str]:
        if tenant is None:
            return [""] * n
        if isinstance(tenant, str):
            tenants = [tenant] * n
        elif isinstance(tenant, SequenceABC):
            tenants = list(tenant)
            if len(tenants) != n:
                raise InvalidRequestError("tenant", f"has {len(tenants)} entries for {n} prompts "
                                                    f"(one per prompt, or one str for all)")
        else:
            raise InvalidRequestError("tenant", f"must be a str or a list of str, one per prompt, "
                                                f"got {type(tenant).__name__}")
        for i, t in enumerate(tenants):
            if not isinstance(t, str):
                raise InvalidRequestError(f"tenant[{i}]", f"must be a str, got {type(t).__name__}")
        if not self.engine.scheduler_config.fair_share and any(tenants):
            raise InvalidRequestError("tenant", "is ignored without fair_share; build the LLM with "
                                                "fair_share=True to share steps between tenants")
        return tenants

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix (vLLM's name); returns the cached KV pages freed."""
        return self.engine.reset_prefix_cache()

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, priority: Sequence[int] | None = None,
             tenant: str | Sequence[str] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} dicts) or a list of
        them, each rendered through the model's chat template with the assistant's turn opened.
        `priority` and `tenant`: as `generate`'s, one per conversation."""
        if _is_messages(messages):
            messages = [messages]
        convs = list(messages)
        for i, c in enumerate(convs):
            if not _is_messages(c):
                raise ValueError(f"messages[{i}]: must be a list of {{'role', 'content'}} dicts")
        return self.generate(convs, sampling_params, use_tqdm, priority=priority, tenant=tenant)

    def get_tokenizer(self):
        """The model's tokenizer (jaxserve.tokenizer.Tokenizer: encode, decode, apply_chat_template)."""
        return self.tokenizer

    def run_until_done(self, total_tokens: int | None = None, use_tqdm: bool = True) -> None:
        from tqdm import tqdm
        with tqdm(total=total_tokens, desc="generating", unit="tok", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                bar.update(sum(len(d.token_ids) for d in self.engine.step()))
