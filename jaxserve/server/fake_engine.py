"""The real `Engine` with a fake runner over the one fake model (engine/fake_model.py).

Everything but the model is the production code: the scheduler (pages, chunked prefill,
preemption, prefix caching), the engine loop (deltas, stop strings, aborts, the idle
invariant) and the incremental detokenizer. `Engine` is handed a `FakeRunner`
(engine/runner_protocol.py), whose `execute` checks each plan against the fake model's paged
KV record (a wrong block table or start position fails the step) and samples each sequence's
next token from a hash of its whole history instead of running a network; it can be told to
sleep (to make phases observable), stall, or raise (to test fault handling).

Used by the server tests and by `jaxserve serve --fake-model` (client development and load
tests of the server itself, with no model and no compilation).

The model, by hand (engine/fake_model.history_hash):
    h = (seed * 7919 + 17) mod 1_000_003, then h = (h * 131 + t + 1) mod 1_000_003 per token t
    next token = EOS (256) if h % 61 == 0 else 32 + h % 95   (a printable ASCII byte)
`seed` is the request's seed for sample 0 and the engine's derived seed for sample i > 0;
a request without a seed uses 0 for every sample. The tokenizer is byte-level with token id
== byte value, plus `<|eos|>` = 256, so the text of ASCII output is `bytes(ids).decode()`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxserve.config import EngineConfig, ModelConfig, SchedulerConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.fake_model import FakeModel, history_hash
from jaxserve.engine.runner import RowInfo, StepResult, sampling_arrays
from jaxserve.engine.runner_protocol import Runner
from jaxserve.tokenizer import Tokenizer
from jaxserve.types import MAX_LOGPROBS

EOS_ID = 256
VOCAB_SIZE = 257
BOS_ID = 257  # only in fake_tokenizer(bos=True)
EOS_PERIOD = 61
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def _grow(pos, tok, n: int) -> None:
    for a in (pos, tok):
        if len(a) < n:
            a.extend([-1] * (n - len(a)))


def printable_or_eos(h: int) -> int:
    """The fake runner's token for history hash h: EOS now and then, else a printable byte."""
    return EOS_ID if h % EOS_PERIOD == 0 else 32 + h % 95


def fake_next_token(history: Sequence[int], seed: int) -> int:
    return printable_or_eos(history_hash(history, seed))


def fake_generate(prompt_ids: Sequence[int], max_tokens: int, seed: int = 0,
                  ignore_eos: bool = False) -> tuple[list[int], str]:
    """Tokens and finish reason of one unaborted sample (no stop strings / stop ids)."""
    hist, out = list(prompt_ids), []
    while True:
        t = fake_next_token(hist, seed)
        hist.append(t)
        out.append(t)
        if t == EOS_ID and not ignore_eos:
            return out, "stop"
        if len(out) >= max_tokens:
            return out, "length"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which tokenizers' ByteLevel uses."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def fake_tokenizer(bos: bool = False) -> Tokenizer:
    """Byte-level: token id == byte value (so any text, any language, round-trips); 256 = EOS.
    With `bos`, a model that wants a BOS (as Gemma's tokenizer does): `<s>` = 257, added in
    front of every encoding with special tokens, and rendered first by the chat template."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken("<|eos|>", special=True)])
    assert hf.token_to_id("<|eos|>") == EOS_ID
    if not bos:
        return Tokenizer(hf, eos_token_ids=[EOS_ID], chat_template=CHAT_TEMPLATE)
    hf.add_special_tokens([AddedToken("<s>", special=True)])
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    return Tokenizer(hf, bos_token_id=BOS_ID, eos_token_ids=[EOS_ID], chat_template="{{ bos_token }}" + CHAT_TEMPLATE)


class FakeRunner:
    """A Runner (engine/runner_protocol.py) over the fake model: no weights, no compilation."""

    def __init__(self, sched: SchedulerConfig, buckets: Sequence[int], warmup_s: float | threading.Event = 0.0):
        self.buckets = tuple(buckets)
        self.max_num_seqs = sched.max_num_seqs
        self.model = FakeModel(sched.page_size, VOCAB_SIZE, token_of=printable_or_eos, num_pages=sched.num_pages)
        self.warmup_s = warmup_s
        self.step_delay_s = 0.0  # sleep in every step, like device time
        self.stall_next_s = 0.0  # one step sleeps this long (a stalled device)
        self.fail_next: BaseException | None = None  # one step raises this
        self.compile_s = 0.0
        self.cache_lost = False  # set by a test: the next fault took the KV cache with it
        self.cache_resets = 0
        self.mask_words = (VOCAB_SIZE + 31) // 32

    def bucket_for(self, num_tokens: int) -> int:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"a step of {num_tokens} tokens exceeds the largest bucket {self.buckets[-1]}")

    def check_row(self, seq, row: RowInfo) -> None:
        sampling_arrays([row], 1)

    def cache_intact(self) -> bool:
        return not self.cache_lost

    def reset_cache(self) -> None:
        self.model.clear_cache()
        self.cache_lost = False
        self.cache_resets += 1

    def forget(self, seq_ids: Sequence[int]) -> None:
        self.model.forget(seq_ids)

    def read_pages(self, full_pages, sliding_pages=()) -> tuple:
        """The pages' (position, token) slots: the fake's KV, for a handover (engine/handover.py)."""
        ps, m = self.model.page_size, self.model
        def grab(pos, tok, pages):
            return [(pos[p * ps + i], tok[p * ps + i]) if p * ps + i < len(pos) else (-1, -1)
                    for p in pages for i in range(ps)]
        return (grab(m.kv_pos, m.kv_tok, full_pages), grab(m.s_pos, m.s_tok, sliding_pages)),

    def write_pages(self, full_pages, sliding_pages, data: tuple) -> None:
        ps, m = self.model.page_size, self.model
        full, sliding = data[0]
        for (pos, tok), pages, slots in (((m.kv_pos, m.kv_tok), full_pages, full),
                                         ((m.s_pos, m.s_tok), sliding_pages, sliding)):
            if pages:
                _grow(pos, tok, (max(pages) + 1) * ps)
            for j, (sp, st) in enumerate(slots):
                i = pages[j // ps] * ps + j % ps
                pos[i], tok[i] = sp, st

    def page_specs(self, num_full: int, num_sliding: int = 0) -> tuple:
        return ()

    def warmup_pages(self) -> float:
        return 0.0

    def warmup(self, progress: bool = True) -> float:
        """Takes warmup_s seconds, or, given an Event, until a test sets it (so a test's
        "during warm-up" lasts as long as the test needs, however loaded the machine)."""
        t0 = time.perf_counter()
        if isinstance(self.warmup_s, threading.Event):
            self.warmup_s.wait()
        else:
            time.sleep(self.warmup_s)
        return time.perf_counter() - t0

    def execute(self, plan, rows: Sequence[RowInfo]) -> StepResult:
        self.bucket_for(plan.num_tokens)  # the real runner refuses such a plan too
        if any(s.draft_len for s in plan.seqs):
            raise ValueError("the fake runner does not verify speculative drafts")
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        # The real runner's host arrays, so a value outside its dtype fails here as it would there.
        sampling_arrays(rows, max(1, len(rows)))
        delay = self.step_delay_s + self.stall_next_s
        self.stall_next_s = 0.0
        if delay:
            time.sleep(delay)
        # The engine's record of each sequence is the truth the fake model checks the plan
        # against (its pages must hold exactly these tokens).
        seeds = []
        for s, r in zip(plan.seqs, rows):
            history = [*r.prompt_ids, *r.output_ids]
            seed = r.seed if r.params.seed is not None else 0
            seeds.append(seed)
            rec = self.model.seqs.get(s.seq_id)
            if rec is None:
                self.model.register(s.seq_id, history, seed)
                if r.output_ids:  # handed over (engine/handover.py): its KV came with it, and
                    # the fake's history check verifies those pages hold its tokens
                    self.model.seqs[s.seq_id].seen = s.start_pos
            else:
                rec.tokens = history
        self.model.write(plan)
        S = len(plan.seqs)
        tokens = np.zeros(S, np.int32)
        for i, (s, r) in enumerate(zip(plan.seqs, rows)):
            if s.sample:
                tokens[i] = self.model.next_token(self.model.seqs[s.seq_id].tokens, seeds[i])
                if r.allowed is not None:  # structured outputs: the hash's pick among the allowed
                    bits = np.unpackbits(r.allowed.view(np.uint8), bitorder="little")[:VOCAB_SIZE]
                    allowed = np.flatnonzero(bits)
                    if tokens[i] not in allowed:
                        tokens[i] = allowed[tokens[i] % len(allowed)]
        # Logprobs: the chosen token at -0.5, then made-up runners-up, best first.
        top_ids = (tokens[:, None] + np.arange(MAX_LOGPROBS)[None, :]) % VOCAB_SIZE
        top_lp = np.broadcast_to(-0.5 - np.arange(MAX_LOGPROBS, dtype=np.float32), (S, MAX_LOGPROBS))
        return StepResult(tokens, np.full(S, -0.5, np.float32), top_ids.astype(np.int32),
                          np.ascontiguousarray(top_lp), tuple((i,) for i in range(S)))


class FakeModelSpec:
    """What Engine reads of a model (its config and dtype); the fake runner needs no weights."""

    def __init__(self, max_model_len: int, vocab_size: int = VOCAB_SIZE):
        self.cfg = ModelConfig(architecture="llama", vocab_size=vocab_size, hidden_size=8,
                               intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                               head_dim=2, max_position_embeddings=max_model_len, eos_token_ids=(EOS_ID,))
        self.dtype = np.dtype(np.float32)


def make_fake_engine(warmup_s: float | threading.Event = 0.0, step_delay_s: float = 0.0,
                     runner: Callable[[SchedulerConfig, Sequence[int]], Runner] | None = None,
                     tokenizer: Tokenizer | None = None, **engine_config) -> Engine:
    """An `Engine` over the fake model; `engine.runner` is the `FakeRunner` (or what `runner`,
    called with the scheduler config and the buckets, makes). `tokenizer`: another byte-level
    tokenizer whose ids 0..256 mean what fake_tokenizer's do (tests add special tokens after
    them, e.g. a BOS); the fake model never samples those extra ids."""
    base = dict(max_model_len=256, page_size=4, num_pages=512, max_num_seqs=16,
                max_num_batched_tokens=64, compilation_cache_dir=None)
    base.update(engine_config)
    cfg = EngineConfig(**base)

    def factory(sched: SchedulerConfig) -> Runner:
        if runner is not None:
            return runner(sched, cfg.buckets())
        r = FakeRunner(sched, cfg.buckets(), warmup_s)
        r.step_delay_s = step_delay_s
        return r

    tok = tokenizer or fake_tokenizer()
    return Engine(FakeModelSpec(cfg.max_model_len or 4096, max(VOCAB_SIZE, tok.vocab_size)), tok, cfg, (EOS_ID,),
                  runner=factory)
