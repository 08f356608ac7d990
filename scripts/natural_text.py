"""Natural-text prompts for the benchmarks, from a small corpus written for this project.

Why not random token ids: a greedy model fed random ids tends to loop, which flatters n-gram
speculation (drafts copied from the loop are kept) and hides the cost of real decode steps. The
corpus (scripts/data/*.txt, original text, no third-party material) mixes English prose,
technical documentation with code, and Chinese, one paragraph per block.

    paragraphs()                              every paragraph, in file order
    text_of_tokens(tokenizer, n, seed)        natural text of about n tokens (paragraphs joined)
    token_prompts(tokenizer, lengths, seed)   token-id prompts of exactly the given lengths, no
                                              two (seed, index) sharing a first KV page
    chat_prompts(tokenizer, lengths, seed)    chat-templated requests of about those lengths:
                                              a task ("summarise", "answer", ...) over a text;
                                              no two share a KV page past the template's own
                                              preamble (a default system prompt)
    prompt_label(seed, i)                     the label both open each prompt with (see below)

A workload file (../shared/workloads/*.json) gives prompt lengths; these functions fill them
with text, seeded, so two runs (or two engines) see the same prompts.
"""

from __future__ import annotations

import random
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
CORPUS_FILES = ("prefix_bench_corpus.txt", "natural_text_docs.txt", "natural_text_zh.txt")

BOUNDARIES = (" ", "\n", "。", "，", "、", "；", "！", "？")

# Chat tasks over a text, as a user would ask them; {text} is the document.
TASKS = (
    "Summarise the following text in a few sentences.\n\n{text}",
    "{text}\n\nWhat is the main point of the text above?",
    "Read this and list three facts it states:\n\n{text}",
    "Explain the following to a beginner, briefly.\n\n{text}",
    "{text}\n\n请用一两句话概括上面的内容。",
)


def paragraphs() -> list[str]:
    """The corpus's paragraphs: blocks separated by blank lines, '#' comment lines dropped."""
    out = []
    for name in CORPUS_FILES:
        text = (DATA / name).read_text(encoding="utf-8")
        lines = [x for x in text.splitlines() if not x.startswith("# ")]
        out += [b.strip() for b in "\n".join(lines).split("\n\n") if b.strip()]
    return out


def _stream(seed: int):
    """Paragraphs forever, starting at a seeded place and in a seeded order per pass."""
    paras = paragraphs()
    rng = random.Random(seed)
    while True:
        order = list(range(len(paras)))
        rng.shuffle(order)
        for i in order:
            yield paras[i]


def text_of_tokens(tokenizer, n: int, seed: int = 0) -> str:
    """Whole paragraphs joined until the text reaches n tokens, then cut back to about n at a
    word boundary (cutting the token list and decoding it would leave half a word)."""
    parts, count = [], 0
    for p in _stream(seed):
        parts.append(p)
        count += len(tokenizer.encode(p + "\n\n"))
        if count >= n:
            break
    text = "\n\n".join(parts)
    ids = tokenizer.encode(text)
    if len(ids) <= n:
        return text
    cut = tokenizer.decode(ids[:n]).rstrip("\ufffd")  # a cut inside a multi-byte character
    # Back to the last word or clause boundary near the end (Chinese has no spaces: its
    # punctuation counts), so the prompt ends on a whole word.
    edge = max(cut.rfind(ch, len(cut) - 64) for ch in BOUNDARIES)
    return cut[:edge + 1].rstrip() if edge > 0 else cut


def prompt_label(seed: int, i: int) -> str:
    """What prompt i of `seed` opens with ("[7.12] "): prompts of different (seed, i) then differ
    within their first few tokens, so no two share a KV page (of 16 tokens) and the prefix cache
    cannot answer part of one from another. The corpus has 43 paragraphs: without the label,
    prompts that began with the same paragraph (or the same task words) were partly answered
    from the prefix cache, flattering the benchmarks (6 of bench_offline's 48 chat prompts
    shared their first 64 tokens). Give every run, rate or trial its own seed and no prompt
    repeats another's."""
    return f"[{seed}.{i}] "


def token_prompts(tokenizer, lengths, seed: int = 0) -> list[list[int]]:
    """One prompt of exactly lengths[i] tokens each: natural text, cut to the length, opening
    with `prompt_label(seed, i)`."""
    out = []
    for i, n in enumerate(lengths):
        label = prompt_label(seed, i)
        ids = tokenizer.encode(label + text_of_tokens(tokenizer, int(n) + 8, seed * 100_003 + i))
        while len(ids) < n:  # the cut at a word boundary can fall short: extend with more text
            ids += tokenizer.encode("\n\n" + text_of_tokens(tokenizer, int(n), seed * 100_003 + i + 7919))
        out.append(ids[:int(n)])
    return out


def chat_prompts(tokenizer, lengths, seed: int = 0) -> list[list[dict[str, str]]]:
    """Chat requests (one user turn: a task over a text) whose templated length is about
    lengths[i] tokens; the template, the label and the task's words are counted, the text fills
    the rest. The user turn opens with `prompt_label(seed, i)`, so two requests share at most
    the template's preamble (SmolLM2's adds a default system prompt, as it does for every real
    request), never a page of their own content."""
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(lengths):
        task = prompt_label(seed, i) + TASKS[rng.randrange(len(TASKS))]
        overhead = len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": task.format(text="")}])))
        text = text_of_tokens(tokenizer, max(1, int(n) - overhead), seed * 100_003 + i)
        out.append([{"role": "user", "content": task.format(text=text)}])
    return out
