"""Speculative decoding by n-gram lookup: the draft proposer, the acceptance rule, the
scheduler's draft planning, and the engine's output, which must equal decoding one token per
step (the dense reference model, token for token) while drafts are actually kept."""

import numpy as np
import pytest
from conftest import assert_dense_greedy, drain, make_engine, staggered_with_drafts

from jaxserve.config import ConfigError, EngineConfig, SchedulerConfig
from jaxserve.scheduler import Scheduler
from jaxserve.scheduler.errors import SchedulerError
from jaxserve.scheduler import speculation
from jaxserve.scheduler.speculation import DraftControl, accept, propose
from jaxserve.types import SamplingParams


def test_propose_copies_what_followed_the_latest_match():
    #          0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 7, 1, 5, 6, 9, 2, 5, 6]
    # "5 6" recurs; its latest earlier occurrence (4..5) was followed by 9 2 5 6.
    assert propose(tokens, 3, ngram_max=3, ngram_min=1) == [9, 2, 5]
    # A longer match wins over a more recent shorter one: "7 1 5" matches only at 2..4.
    assert propose([7, 1, 5, 8, 5, 3, 7, 1, 5], 2, ngram_max=3, ngram_min=1) == [8, 5]


def test_propose_nothing_without_recurrence_or_budget():
    assert propose([1, 2, 3, 4], 4, ngram_max=3, ngram_min=1) == []
    assert propose([1, 2, 1, 2], 0, ngram_max=3, ngram_min=1) == []
    # Only a 1-gram recurs, and 2 are required.
    assert propose([3, 9, 4, 9], 2, ngram_max=3, ngram_min=2) == []


def test_propose_continues_a_short_period_past_the_end():
    # Period 2: the copy runs into the end of the history and continues with itself.
    assert propose([8, 1, 2, 1, 2], 5, ngram_max=2, ngram_min=1) == [1, 2, 1, 2, 1]


def test_accept_keeps_agreeing_drafts_then_the_models_token():
    assert accept([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all kept, plus the bonus token
    assert accept([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # first disagreement ends it
    assert accept([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accept([], [3]) == [3]


def test_config_limits_are_named():
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=9)
    with pytest.raises(ConfigError, match="ngram_min"):
        EngineConfig(num_speculative_tokens=2, ngram_max=2, ngram_min=3)


def _sched(**kw):
    base = dict(num_pages=64, max_model_len=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                num_speculative_tokens=3)
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))


def _decode_once(sched, seq_id_tokens):
    """Run the prefill step, answering with the given first token per seq id."""
    plan = sched.schedule()
    sched.update(plan, {s.seq_id: seq_id_tokens[s.seq_id] for s in plan.seqs if s.sample})


def test_scheduler_drafts_for_greedy_and_sampled_decodes_within_limits():
    sched = _sched(max_num_batched_tokens=32)
    loop = [7, 8, 7, 8, 7, 8]
    g = sched.add_request("greedy", loop, SamplingParams(temperature=0.0, max_tokens=10))[0]
    t = sched.add_request("sampled", loop, SamplingParams(max_tokens=10, temperature=0.8))[0]
    p = sched.add_request("penalised", loop, SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.2))[0]
    near_end = sched.add_request("two-left", loop, SamplingParams(temperature=0.0, max_tokens=3))[0]
    _decode_once(sched, {g: 7, t: 7, p: 7, near_end: 7})
    plan = sched.schedule()
    by_id = {s.seq_id: s for s in plan.seqs}
    assert by_id[g].draft == (8, 7, 8) and by_id[g].token_ids == (7, 8, 7, 8)
    assert by_id[t].draft == (8, 7, 8)  # sampled rows speculate too (verified by the rejection rule)
    assert by_id[p].draft_len == 0  # a penalty's logits would depend on the drafts before them
    # max_tokens 3 with 1 output so far: this step may add at most 2 tokens, so 1 draft.
    assert by_id[near_end].draft == (8,)
    # Every drafted run has pages for all its tokens.
    for s in plan.seqs:
        assert len(s.block_table) * 4 >= s.start_pos + s.num_tokens
    # Kept drafts plus one token advance the sequence; the rest are dropped.
    events = sched.update(plan, {g: [8, 7, 5], t: [8, 1], p: 2, near_end: [8, 7]})
    assert [e.token_id for e in events if e.seq_id == g] == [8, 7, 5]
    assert [e.token_id for e in events if e.seq_id == t] == [8, 1]
    assert sched.get_sequence(g).num_computed_tokens == len(loop) + 3
    assert [(e.token_id, e.finished) for e in events if e.seq_id == near_end] == [(8, False), (7, True)]
    sched.check_invariants()


def test_scheduler_refuses_tokens_that_do_not_follow_the_drafts():
    sched = _sched()
    g = sched.add_request("g", [1, 2, 1, 2], SamplingParams(temperature=0.0, max_tokens=10))[0]
    _decode_once(sched, {g: 1})
    plan = sched.schedule()
    assert plan.seqs[0].draft == (2, 1, 2)
    with pytest.raises(SchedulerError, match="kept drafts"):
        sched.update(plan, {g: [3, 1]})  # 3 disagrees with the draft 2, so nothing follows it
    # Refused as a whole: the state is as if the plan was discarded.
    sched.check_invariants()
    assert sched.get_sequence(g).num_computed_tokens == 4 and sched.get_sequence(g).output_ids == [1]


def test_draft_control_shrinks_pauses_retries_and_grows():
    d = DraftControl(7)
    assert d.limit(0) == 7
    d.record(7, 7, 8)
    assert d.k == 7  # all kept: stays at (doubles up to) the most
    d.record(7, 2, 11)
    assert d.k == 3  # some kept: the kept count plus one
    d.record(3, 0, 12)
    d.record(1, 0, 13)
    assert d.k == 1 and d.limit(13) == 1  # two misses: halved, still drafting
    d.record(1, 0, 14)  # the third miss in a row pauses it for PAUSE_MIN of its own tokens
    pause = speculation.PAUSE_MIN
    assert d.limit(14) == 0 and d.limit(14 + pause - 1) == 0 and d.limit(14 + pause) == 1
    d.record(1, 0, 15 + pause)  # the retry misses: paused again, twice as long
    assert d.limit(15 + pause) == 0 and d.limit(15 + 3 * pause - 1) == 0 and d.limit(15 + 3 * pause) == 1
    d.record(1, 1, 14 + 3 * pause + 2)  # a kept draft: growing again, pauses back to the shortest
    assert (d.k, d.misses, d.pause) == (2, 0, pause)
    d.record(2, 2, 14 + 3 * pause + 5)
    assert d.k == 4
    d.record(0, 0, 99)  # a run without drafts says nothing
    assert d.k == 4


@pytest.mark.parametrize("adaptive", [True, False])
def test_scheduler_stops_drafting_where_drafts_keep_failing(adaptive):
    sched = _sched(adaptive_speculation=adaptive, num_speculative_tokens=4, max_model_len=128,
                   max_num_batched_tokens=32)
    g = sched.add_request("g", [1, 2, 1, 2], SamplingParams(temperature=0.0, max_tokens=60))[0]
    _decode_once(sched, {g: 1})
    lengths = []
    for _ in range(13):
        plan = sched.schedule()
        s = plan.seqs[0]
        lengths.append(s.draft_len)
        sched.update(plan, {g: [9] if s.draft_len else 9})  # the model never agrees with a draft
    # The second step has no draft to propose ("9" has not recurred yet); from the third on,
    # the history ends ...9 9 and n-gram lookup always proposes one.
    if adaptive:
        # Halved twice, then paused for PAUSE_MIN of its tokens, then one retry draft.
        assert lengths == [4, 0, 2, 1] + [0] * speculation.PAUSE_MIN + [1], lengths
    else:
        assert lengths == [4, 0] + [4] * 11, lengths
    sched.check_invariants()


def test_drafts_only_take_budget_nothing_else_needs():
    # A budget of 6 tokens and 4 requests of 4 prompt tokens: while prompts still wait or
    # prefill, drafts never take their tokens; once all 4 decode, drafts get the 2 left.
    sched = _sched(max_num_batched_tokens=6)
    ids = [sched.add_request(str(i), [3, 4, 3, 4], SamplingParams(temperature=0.0, max_tokens=20))[0] for i in range(4)]
    for _ in range(20):
        plan = sched.schedule()
        assert plan.num_tokens <= 6
        if any(s.draft_len for s in plan.seqs):
            # Drafts only where no prompt waited and no prefill chunk was cut short.
            assert sched.num_waiting == 0 and all(s.sample for s in plan.seqs)
        if all(s.sample and s.num_tokens - s.draft_len == 1 for s in plan.seqs) and len(plan.seqs) == 4:
            break
        sched.update(plan, {s.seq_id: 3 for s in plan.seqs if s.sample})
    else:
        raise AssertionError("the four requests never decoded together")
    assert sorted(s.seq_id for s in plan.seqs) == ids
    assert plan.num_tokens == 6 and sum(s.draft_len for s in plan.seqs) == 2


def _prompts(lm):
    rng = np.random.default_rng(3)
    texts = ["List the days of the week: Monday, Tuesday,", "1, 2, 3, 4, 5, 6,",
             "The capital of France is", "def add(a, b):\n    return a + b\n\ndef"]
    prompts = [lm.tokenizer.encode(t) for t in texts]
    return prompts + [rng.integers(3, 49152, size=int(n)).tolist() for n in (5, 40)]


def test_engine_with_drafts_equals_dense_greedy_on_smollm2(smollm2):
    """Drafts verified in the same steps as chunked prefills, with a pool small enough to
    preempt: every greedy output equals the dense model's one-token-at-a-time output."""
    lm = smollm2
    prompts = _prompts(lm)
    eng = make_engine(lm.model, lm.tokenizer, lm.eos_token_ids, max_model_len=256, page_size=4,
                      num_pages=31, max_num_seqs=8, max_num_batched_tokens=32, token_buckets=(1, 8, 32),
                      num_speculative_tokens=3)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    got, outputs = staggered_with_drafts(eng, prompts, params)
    assert_dense_greedy(lm.model, prompts, [g.token_ids for g in got], params.max_tokens)  # ignore_eos
    for i, g in enumerate(got):
        assert "".join(d.text for d in outputs if d.request_id == str(i)) == g.text


def test_engine_with_drafts_keeps_stops_and_logprobs(tiny_model):
    """A stop string or stop token inside a run of kept drafts ends the output exactly there;
    logprobs are those of one-token-at-a-time decoding."""
    model, tok = tiny_model
    prompt = {"prompt_token_ids": [65, 66, 67, 65, 66, 67, 65, 66]}
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    # One bucket each (the steps here need at most 3 x 5 tokens, or a 24-token prefill):
    # compiling the default three took most of this test's time.
    eng = make_engine(model, tok, token_buckets=(32,))
    eng.add_request(prompt, free, request_id="free")
    drain(eng)
    plain = eng.pop_finished("free").outputs[0]
    # Stop at the 10th token's text and at its id, with drafts running past both.
    stop_tok = plain.token_ids[9]
    cut = tok.decode(plain.token_ids[:10])
    stop_str = cut[-2:]
    want_text = cut[:cut.find(stop_str)]
    eng = make_engine(model, tok, token_buckets=(32,), num_speculative_tokens=4)
    eng.add_request(prompt, free, request_id="free")
    eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop_str]), request_id="s")
    eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_tok]),
                    request_id="t")
    drain(eng)
    assert eng.stats["accepted_draft_tokens"] > 0, "no draft was ever kept: speculation did not run"
    spec = eng.pop_finished("free").outputs[0]
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    for a, b in zip(spec.logprobs, plain.logprobs, strict=True):
        assert a.token_id == b.token_id and [i for i, _ in a.top] == [i for i, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    s, t = eng.pop_finished("s").outputs[0], eng.pop_finished("t").outputs[0]
    assert s.finish_reason == "stop" and s.text == want_text
    first = plain.token_ids.index(stop_tok)
    assert t.finish_reason == "stop" and t.token_ids == plain.token_ids[:first + 1]


def test_acceptance_reaches_the_server_metrics():
    """The engine's draft counts become the server's counters (deltas, each once) and the
    acceptance-rate gauge; no engine needed, only the gauge update (server/engine_gauges.py)."""
    from types import SimpleNamespace

    from jaxserve.engine.engine import Engine
    from jaxserve.server.engine_gauges import EngineGauges
    from jaxserve.server.metrics import ServerMetrics

    stats = {"preemptions": 0, "draft_tokens": 40, "accepted_draft_tokens": 10, "drafts": 20, "steps": 0,
             "computed_tokens": 0}
    positions = {"drafted": [20, 20], "accepted": [8, 2]}
    engine = SimpleNamespace(
        stats=stats, compiles_after_warmup=0, spec_positions=positions,
        scheduler=SimpleNamespace(num_running=0, num_waiting=0, kv_pages=lambda: (1, 8)),
        prefix_cache_stats=lambda: {"queries": 0, "hits": 0, "cached_pages": 0, "evictions": 0})
    engine.draft_acceptance = Engine.draft_acceptance.fget(engine)
    gauges = EngineGauges(ServerMetrics())
    gauges.update(engine, 0)
    stats.update(draft_tokens=60, accepted_draft_tokens=30, drafts=30)
    positions["accepted"] = [20, 10]
    engine.draft_acceptance = Engine.draft_acceptance.fget(engine)
    gauges.update(engine, 0)
    text = gauges.metrics.exposition().decode()
    assert "jaxserve_spec_decode_num_draft_tokens_total 60.0" in text
    assert "jaxserve_spec_decode_num_accepted_tokens_total 30.0" in text
    assert "jaxserve_spec_decode_num_drafts_total 30.0" in text
    assert 'jaxserve_spec_decode_num_accepted_tokens_per_pos_total{position="0"} 20.0' in text
    assert 'jaxserve_spec_decode_num_accepted_tokens_per_pos_total{position="1"} 10.0' in text
    assert "jaxserve_spec_decode_draft_acceptance_rate 0.5" in text
    assert Engine.mean_accepted_length.fget(engine) == 2.0  # 30 runs emitted 30 kept + 30 own tokens


def test_engine_counts_drafts_per_position(tiny_model):
    model, tok = tiny_model
    eng = make_engine(model, tok, token_buckets=(32,), num_speculative_tokens=3)
    eng.add_request({"prompt_token_ids": [65, 66, 67, 65, 66, 67, 65, 66]},
                    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), request_id="r")
    drain(eng)
    st, pos = eng.stats, eng.spec_positions
    assert st["drafts"] > 0 and sum(pos["drafted"]) == st["draft_tokens"] and sum(pos["accepted"]) == st["accepted_draft_tokens"]
    # A run keeps a prefix of its drafts: position i + 1 is kept no more often than position i.
    assert all(a >= b for a, b in zip(pos["accepted"], pos["accepted"][1:])) and pos["drafted"][0] == st["drafts"]


def test_n_samples_with_drafts_equal_dense_greedy_and_free_every_page(tiny_model):
    """n = 3 greedy samples share the prompt's pages (scheduler/sharing.py) and draft each on
    their own: all three are the dense model's output, and the pool is empty afterwards."""
    model, tok = tiny_model
    prompt = [65, 66, 67, 65, 66, 67, 65, 66, 67, 65, 66]
    eng = make_engine(model, tok, token_buckets=(32,), num_speculative_tokens=3)
    eng.add_request({"prompt_token_ids": prompt}, SamplingParams(n=3, temperature=0.0, max_tokens=24, ignore_eos=True),
                    request_id="r")
    drain(eng)
    outs = eng.pop_finished("r").outputs
    assert eng.stats["accepted_draft_tokens"] > 0
    assert_dense_greedy(model, [prompt] * 3, [o.token_ids for o in outs], 24)
    eng.scheduler.check_invariants()
    assert eng.scheduler.kv_pages()[0] == 0, "pages still held after every sample finished"
