"""/v1/completions and /v1/chat/completions over the shared Frontend.

A call: protocol.py turns the body into RequestSpecs -> Frontend.submit (the same checks, queue
bound and tokenizer pool as gRPC) -> the engine's deltas become OpenAI JSON (one body) or SSE
chunks -> Frontend.close in `finally`. A cancelled handler (the client went away; routes.py
cancels non-streaming calls on disconnect and Starlette cancels a stream) lands in that
`finally`, which aborts the request in the engine, so its KV pages are free before the next step.

Several prompts in one completions call are several engine requests, admitted in order (all or
nothing: a refusal closes the ones already admitted); their choices are numbered
prompt_index * n + sample_index, as OpenAI does.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from jaxserve.server import tenancy
from jaxserve.server.frontend import Frontend, Submission
from jaxserve.server.openai_api import protocol
from jaxserve.types import RequestOutput, StepOutput, TokenLogprob


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


def usage_of(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Serving:
    def __init__(self, frontend: Frontend, model_name: str):
        self.frontend = frontend
        self.model_name = model_name
        self._token_text: dict[int, str] = {}

    # ---- shared ----------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens included), for logprobs."""
        s = self._token_text.get(token_id)
        if s is None:
            s = self.frontend.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 1 << 16:
                self._token_text[token_id] = s
        return s

    async def submit_all(self, specs, tenant: str) -> list[Submission]:
        subs: list[Submission] = []
        try:
            for spec in specs:
                # The caller's tenant: its prefix-cache namespace, fair share and quotas (as gRPC's).
                subs.append(await self.frontend.submit(tenancy.salt(spec, tenant)))
        except BaseException:
            for s in subs:
                self.frontend.close(s)
            raise
        return subs

    async def _merged(self, subs: list[Submission]) -> AsyncIterator[tuple[int, list[StepOutput], RequestOutput | None]]:
        """(prompt index, deltas, finished output or None) from every submission as they come."""
        if len(subs) == 1:
            async for deltas, fin in self.frontend.stream(subs[0]):
                yield 0, deltas, None if fin is None else fin.output
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, sub: Submission) -> None:
            try:
                async for deltas, fin in self.frontend.stream(sub):
                    q.put_nowait((i, deltas, None if fin is None else fin.output, None))
            except Exception as e:  # a ServingError for this prompt ends the whole call
                q.put_nowait((i, [], None, e))
        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(subs)]
        try:
            left = len(subs)
            while left:
                i, deltas, out, err = await q.get()
                if err is not None:
                    raise err
                if out is not None:
                    left -= 1
                yield i, deltas, out
        finally:
            for t in tasks:
                t.cancel()

    def _created(self) -> int:
        return int(time.time())

    # ---- completions -----------------------------------------------------------------------

    def _completion_logprobs(self, lps: list[TokenLogprob] | None, offset: int) -> dict | None:
        if lps is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            s = self.token_text(lp.token_id)
            tokens.append(s)
            token_lps.append(lp.logprob)
            tops.append({self.token_text(t): v for t, v in lp.top})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _echo_logprobs(self, out: RequestOutput, n: int) -> dict:
        """OpenAI's echo + logprobs: the prompt's tokens first, the first with no logprob."""
        lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
        for t, lp in zip(out.prompt_token_ids, lps):
            s = self.token_text(t)
            tokens.append(s)
            token_lps.append(None if lp is None else lp.logprob)
            tops.append(None if lp is None else {self.token_text(i): v for i, v in lp.top[:n]})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _prompt_logprobs(self, out: RequestOutput) -> list | None:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id:
        {"logprob", "decoded_token"}} for the token itself and the top ones."""
        if out.prompt_logprobs is None:
            return None
        res = []
        for lp in out.prompt_logprobs:
            if lp is None:
                res.append(None)
                continue
            entry = {str(i): {"logprob": v, "decoded_token": self.token_text(i)} for i, v in lp.top}
            entry[str(lp.token_id)] = {"logprob": lp.logprob, "decoded_token": self.token_text(lp.token_id)}
            res.append(entry)
        return res

    def _echo(self, spec) -> str:
        if spec.text is not None:
            return spec.text
        return self.frontend.tokenizer.decode(spec.token_ids, skip_special_tokens=False)

    async def build(self, fn, req, tenant: str):
        """`fn(req)` -> the request's specs. A request with a grammar is built on the tokenizer
        pool: compiling a JSON schema or regex (GrammarCompiler.check) costs ~1 ms for a small
        one and grows with the schema, and on the event loop it would stall every other stream."""
        if protocol.has_grammar(req):
            return await self.frontend.off_loop(fn, req, tenant=tenant)
        return fn(req)

    async def completions(self, req: protocol.CompletionRequest, tenant: str):
        specs = await self.build(protocol.completion_specs, req, tenant)
        subs = await self.submit_all(specs, tenant)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            return self._completion_stream(req, specs, subs, rid)
        try:
            outs: list[RequestOutput | None] = [None] * len(subs)
            async for i, _deltas, out in self._merged(subs):
                if out is not None:
                    outs[i] = out
        finally:
            for s in subs:
                self.frontend.close(s)
        n = req.n
        choices = []
        for i, out in enumerate(outs):
            prefix = self._echo(specs[i]) if req.echo else ""
            echo_lps = self._echo_logprobs(out, req.logprobs) if req.echo and req.logprobs is not None else None
            for c in out.outputs:
                lps = self._completion_logprobs(c.logprobs, len(prefix))
                if echo_lps is not None:
                    lps = {k: echo_lps[k] + lps[k] for k in lps}
                choice = {"index": i * n + c.index, "text": prefix + c.text, "logprobs": lps,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(out)
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        return {"id": rid, "object": "text_completion", "created": self._created(),
                "model": self.model_name, "choices": choices, "usage": usage_of(outs)}

    async def _completion_stream(self, req, specs, subs, rid) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created, n = self._created(), req.n
        offsets: dict[int, int] = {}

        def chunk(choices, usage=None):
            c = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                 "choices": choices}
            if include_usage:
                c["usage"] = usage
            return _sse(c)
        try:
            if req.echo:
                for i, spec in enumerate(specs):
                    text = self._echo(spec)
                    for k in range(n):
                        offsets[i * n + k] = len(text)
                        yield chunk([{"index": i * n + k, "text": text, "logprobs": None,
                                      "finish_reason": None}])
            outs = []
            async for i, deltas, out in self._merged(subs):
                for d in deltas:
                    if not (d.text or d.token_ids or d.finished):
                        continue
                    idx = i * n + d.index
                    off = offsets.get(idx, 0)
                    offsets[idx] = off + len(d.text)
                    yield chunk([{"index": idx, "text": d.text,
                                  "logprobs": self._completion_logprobs(d.logprobs, off),
                                  "finish_reason": d.finish_reason if d.finished else None}])
                if out is not None:
                    outs.append(out)
            if include_usage:
                yield chunk([], usage_of(outs))
            yield DONE
        finally:
            for s in subs:
                self.frontend.close(s)

    # ---- chat ------------------------------------------------------------------------------

    def _chat_logprobs(self, lps: list[TokenLogprob] | None) -> dict | None:
        if lps is None:
            return None

        def entry(t: int, v: float) -> dict:
            s = self.token_text(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}
        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}

    async def chat(self, req: protocol.ChatCompletionRequest, tenant: str):
        spec, to_context = await self.build(protocol.chat_spec, req, tenant)
        spec.max_tokens_to_context = to_context
        subs = await self.submit_all([spec], tenant)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return self._chat_stream(req, subs, rid)
        try:
            out = None
            async for _i, _deltas, o in self._merged(subs):
                out = o or out
        finally:
            self.frontend.close(subs[0])
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(c.logprobs), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}
                   for c in out.outputs]
        return {"id": rid, "object": "chat.completion", "created": self._created(),
                "model": self.model_name, "choices": choices, "usage": usage_of([out])}

    async def _chat_stream(self, req, subs, rid) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = self._created()

        def chunk(choices, usage=None):
            c = {"id": rid, "object": "chat.completion.chunk", "created": created,
                 "model": self.model_name, "choices": choices}
            if include_usage:
                c["usage"] = usage
            return _sse(c)
        try:
            for k in range(req.n):
                yield chunk([{"index": k, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            out = None
            async for _i, deltas, o in self._merged(subs):
                for d in deltas:
                    if d.text or d.token_ids:
                        yield chunk([{"index": d.index, "delta": {"content": d.text},
                                      "logprobs": self._chat_logprobs(d.logprobs), "finish_reason": None}])
                    if d.finished:
                        yield chunk([{"index": d.index, "delta": {}, "logprobs": None,
                                      "finish_reason": d.finish_reason}])
                out = o or out
            if include_usage:
                yield chunk([], usage_of([out]))
            yield DONE
        finally:
            self.frontend.close(subs[0])
