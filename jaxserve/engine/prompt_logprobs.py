"""prompt_logprobs (vLLM's): each prompt token's logprob under the model given the tokens before
it, gathered from the steps that compute the prompt.

The step (step_program.py, `prompt_targets`) projects every token of a step onto the vocabulary only
in steps where some row asks; the token at position p of a prompt yields the logprob of prompt
token p + 1. Prompts are computed in chunks over several steps, and again after a preemption:
each position is recorded the first time it is computed. A request with prompt_logprobs stays
out of the shared prefix cache (scheduler.add_request), so every prompt token is computed once
by it (or by its first sample, whose pages its other samples share).
"""

from __future__ import annotations

from jaxserve.types import TokenLogprob


def record(plan, result, reqs) -> None:
    """`reqs[i]`: the RequestState of plan.seqs[i]. Fills `req.prompt_logprobs` (one entry per
    prompt token, None for the first) from the step's per-token results."""
    if result.prompt_logprob is None:  # a runner without them (the fake model's)
        return
    off = 0
    for s, req in zip(plan.seqs, reqs):
        k = len(s.token_ids)
        n = req.params.prompt_logprobs
        if n is not None:
            prompt = req.prompt_ids
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None] * len(prompt)
            # The same positions as runner.build_inputs' prompt_targets.
            for j, p in enumerate(range(s.start_pos, min(s.start_pos + k, len(prompt) - 1))):
                if req.prompt_logprobs[p + 1] is None:
                    i = off + j
                    top = [(int(result.prompt_top_ids[i, q]), float(result.prompt_top_logprobs[i, q]))
                           for q in range(n)]
                    req.prompt_logprobs[p + 1] = TokenLogprob(prompt[p + 1], float(result.prompt_logprob[i]), top)
        off += k
