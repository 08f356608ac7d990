"""Draft tokens for speculative decoding by n-gram lookup ("prompt lookup decoding").

A greedy decode proposes the tokens that followed the last place its own history (prompt and
outputs) repeated its latest n tokens; the step then runs the decode token and the drafts as
one short run, and the engine keeps the longest prefix of drafts the model's argmax agrees
with plus the model's own next token (see `accept`). The output is exactly what one token per
step would give; only the number of steps changes. No draft model: the cost is the wider
step, which is nearly free while decode is memory-bound, and pays off when text repeats
itself (quoting the prompt, code edits, lists; or a small model looping).

Pure host Python, no jax: the scheduler calls it while it plans a step.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose(tokens: Sequence[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Up to `k` tokens to follow `tokens`: find the most recent earlier occurrence of the
    longest suffix of `tokens` with ngram_min <= length <= ngram_max, and copy what followed
    it. Where the copy runs into the end of `tokens`, it continues with its own tokens (a
    repeating pattern of period p keeps predicting itself). [] if no suffix recurs."""
    n = len(tokens)
    if k <= 0 or n < ngram_min + 1:
        return []
    last = tokens[-1]
    best_at, best_len = -1, 0
    # Candidates: earlier positions i holding the last token, most recent first.
    for i in range(n - 2, -1, -1):
        if tokens[i] != last:
            continue
        m = 1
        while m < ngram_max and i - m >= 0 and tokens[i - m] == tokens[n - 1 - m]:
            m += 1
        if m > best_len:
            best_at, best_len = i, m
            if m == ngram_max:
                break
    if best_len < ngram_min:
        return []
    draft: list[int] = []
    src = best_at + 1
    for t in range(k):
        j = src + t
        draft.append(tokens[j] if j < n else draft[j - n])
    return draft


def accept(draft: Sequence[int], predicted: Sequence[int]) -> list[int]:
    """The tokens a verified run yields: `predicted[j]` is the model's (greedy) token after
    the run's token j (the decode token, then the drafts), so len(predicted) = len(draft) + 1.
    Drafts are kept while the model agrees; the first disagreement, or the end, adds the
    model's own token. Returns 1 .. len(draft) + 1 tokens."""
    out = []
    for d, p in zip(draft, predicted):
        out.append(p)
        if p != d:
            return out
    out.append(predicted[len(draft)])
    return out
