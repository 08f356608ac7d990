"""Prefill/decode disaggregation in virtual time, for capacity.py's statistics: one prefill and
one decode engine (the real Engine and scheduler, the fake runner), each on a device of its own
with its own clock, and the KV handover between them (engine/handover.py, the same code the
real engines run) costing `latency + bytes / bandwidth` seconds.

How the clocks advance: the engine whose next event is earliest moves (the prefill engine's is
its clock while it has work, else the next arrival; the decode engine's its clock while it has
work, else the earliest handover to land). A handover made at prefill time t lands at t + its
transfer time; the decode engine admits landed handovers before each step, in order, as its
pool and running slots allow (NoRoomForHandover: it waits). Since the earlier clock always
moves, a handover can land at most one decode step before the decode engine next looks: that
step is the simulation's only approximation.

What a client sees: the first token at the prefill engine's clock (TTFT), the rest at the
decode engine's; the handover's transfer and wait fall between the first and second token, so
they are in TPOT, as a client would measure it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

from capacity_targets import Outcome, record_deltas
from capacity_workload import Request


class DisaggSimTarget:
    def __init__(self, make_engine: Callable[[], object], step_cost: Callable[[int, int], float],
                 page_bytes: int, transfer_gbps: float, transfer_latency_s: float = 0.0):
        """step_cost(step tokens, KV tokens held) -> seconds; page_bytes: one KV page of every
        layer (K and V), what a handover moves per page; transfer_gbps: the link, GB/s."""
        self.make_engine = make_engine
        self.step_cost = step_cost
        self.page_bytes = page_bytes
        self.transfer_gbps = transfer_gbps
        self.transfer_latency_s = transfer_latency_s

    def transfer_s(self, pages: int) -> float:
        return self.transfer_latency_s + pages * self.page_bytes / (self.transfer_gbps * 1e9)

    def run(self, requests: list[Request], arrivals: list[float]):
        from jaxserve.scheduler.handover import NoRoomForHandover
        from jaxserve.types import InvalidRequestError, SamplingParams
        p, d = self.make_engine(), self.make_engine()
        tp = td = 0.0
        i, outcomes, by_id = 0, [], {}
        landing: list[tuple[float, int, object, object]] = []  # (lands at, order, handover, data)
        order = 0
        stats = {"handovers": 0, "transfer_bytes": 0, "transfer_s": 0.0, "handover_wait_s": 0.0,
                 "preemptions": 0, "peak_kv_usage": 0.0, "prefill_queue_peak": 0}

        def cost(eng, tokens):
            held, _ = eng.scheduler.kv_pages()
            return self.step_cost(tokens, held * eng.scheduler.config.page_size)

        for _ in range(10_000_000):
            p_next = tp if p.has_unfinished() else (arrivals[i] if i < len(requests) else math.inf)
            d_next = td if d.has_unfinished() else (landing[0][0] if landing else math.inf)
            if p_next == math.inf and d_next == math.inf:
                break
            if p_next <= d_next:
                tp = max(tp, p_next)
                while i < len(requests) and arrivals[i] <= tp:
                    r = requests[i]
                    o = Outcome(r.tenant, r.max_tokens, sent=arrivals[i])
                    outcomes.append(o)
                    i += 1
                    try:
                        rid = p.add_request({"prompt_token_ids": r.prompt_ids},
                                            SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True),
                                            request_id=f"r{i - 1}", tenant=r.tenant, hand_over=True)
                        by_id[rid] = o
                    except InvalidRequestError:
                        o.code = "INVALID_ARGUMENT"
                if not p.has_unfinished():
                    continue
                stats["prefill_queue_peak"] = max(stats["prefill_queue_peak"], p.scheduler.num_waiting)
                before = p.stats["computed_tokens"]
                deltas = p.step()
                tp += cost(p, p.stats["computed_tokens"] - before)
                record_deltas(by_id, deltas, tp)
                for dl in deltas:
                    if dl.finished:  # ended by its first token: never handed over
                        p.pop_finished(dl.request_id)
                for rid in list(p.handovers):
                    h, data = p.pop_handover(rid)
                    pages = h.full_pages + h.sliding_pages
                    t = self.transfer_s(pages)
                    stats["handovers"] += 1
                    stats["transfer_bytes"] += pages * self.page_bytes
                    stats["transfer_s"] += t
                    heapq.heappush(landing, (tp + t, order, h, data))
                    order += 1
            else:
                td = max(td, d_next)
                while landing and landing[0][0] <= td:
                    lands, _, h, data = landing[0]
                    try:
                        d.import_request(h, data)
                    except NoRoomForHandover:
                        if not d.has_unfinished():
                            raise RuntimeError(f"{h.request_id}: the decode engine is empty and still "
                                               f"has no room for it") from None
                        break
                    heapq.heappop(landing)
                    stats["handover_wait_s"] += td - lands
                if not d.has_unfinished():
                    continue
                before = d.stats["computed_tokens"]
                deltas = d.step()
                td += cost(d, d.stats["computed_tokens"] - before)
                record_deltas(by_id, deltas, td)
                held, usable = d.scheduler.kv_pages()
                stats["peak_kv_usage"] = max(stats["peak_kv_usage"], held / usable)
                for dl in deltas:
                    if dl.finished:
                        d.pop_finished(dl.request_id)
        else:
            raise RuntimeError("the simulation did not end")
        stats["preemptions"] = p.stats["preemptions"] + d.stats["preemptions"]
        n = max(1, stats["handovers"])
        stats["mean_transfer_s"] = stats["transfer_s"] / n
        stats["mean_handover_wait_s"] = stats["handover_wait_s"] / n
        return outcomes, max(tp, td), stats
