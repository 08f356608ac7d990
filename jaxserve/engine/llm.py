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
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.config_engine import LIMIT_FIELDS
from jaxserve.engine.build import build_engine
from jaxserve.types import RequestOutput, SamplingParams


def _is_messages(p: Any) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(m, dict) and "role" in m for m in p)


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", progress: bool = True,
                 quantize: str = "none", quantize_group_size: int | None = None, quant_impl: str = "auto",
                 matmul_impl: str = "auto", engine_config: EngineConfig | None = None, **engine_options: Any):
        """model, dtype, quantize, quantize_group_size, quant_impl, matmul_impl: the LoadConfig fields (the
        `--model`, `--dtype`, `--quantize` ... flags; dtype "auto" = bfloat16 on TPU/GPU,
        float32 on CPU). The engine: `engine_config`, or its fields as keywords (max_num_seqs=8,
        tp=2, ...; vLLM-style flat), not both."""
        fields = {f.name for f in dataclasses.fields(EngineConfig)} | LIMIT_FIELDS
        unknown = sorted(set(engine_options) - fields)
        if unknown:
            raise TypeError(f"LLM() got unknown engine options {unknown}; known: {sorted(fields)}")
        if engine_config is not None and engine_options:
            raise TypeError("LLM() takes engine_config or engine options as keywords, not both")
        config = engine_config or EngineConfig(**engine_options)
        load = LoadConfig(model=None if model is None else str(model), dtype=dtype, quantize=quantize,
                          quantize_group_size=quantize_group_size, quant_impl=quant_impl,
                          matmul_impl=matmul_impl)
        # This process's own devices: in a multi-process job each process is its own replica
        # with its own prompts (scripts/generate_batch.py), so a mesh over the job's first
        # devices would leave every other process with none of its own.
        self.loaded, self.engine = build_engine(load, config, local_devices=True, progress=progress)
        self.warmup_s = self.engine.warmup(progress)
        self.tokenizer = self.loaded.tokenizer

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or _is_messages(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        self.run_until_done(total_tokens=sum(sp.max_tokens * sp.n for sp in params), use_tqdm=use_tqdm)
        return [self.engine.pop_finished(i) for i in ids]

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix (vLLM's name); returns the cached KV pages freed."""
        return self.engine.reset_prefix_cache()

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} dicts) or a list of
        them, each rendered through the model's chat template with the assistant's turn opened."""
        if _is_messages(messages):
            messages = [messages]
        convs = list(messages)
        for i, c in enumerate(convs):
            if not _is_messages(c):
                raise ValueError(f"messages[{i}]: must be a list of {{'role', 'content'}} dicts")
        return self.generate(convs, sampling_params, use_tqdm)

    def get_tokenizer(self):
        """The model's tokenizer (jaxserve.tokenizer.Tokenizer: encode, decode, apply_chat_template)."""
        return self.tokenizer

    def run_until_done(self, total_tokens: int | None = None, use_tqdm: bool = True) -> None:
        from tqdm import tqdm
        with tqdm(total=total_tokens, desc="generating", unit="tok", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                bar.update(sum(len(d.token_ids) for d in self.engine.step()))
