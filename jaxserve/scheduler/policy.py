"""Scheduling policy: the order of the waiting and running lists, and tenant fair sharing.

Sort key of a sequence (smaller = served first, preempted last):

    (0 if protected else 1, effective priority, arrival_index, sample_index)

  - protected: preempted `max_preemptions_per_request` times (scheduler.py); outranks the rest,
    so a sequence cannot be preempted forever.
  - effective priority: 0 under "fcfs" (plain arrival order). Under "priority" it is
    `priority + aging_rate * arrival_step`: the request's priority minus what it gained by
    ageing (`aging_rate` levels per scheduler step since it arrived), shifted by the common term
    `aging_rate * now`, which every sequence shares and so cannot change their order. The key
    is therefore fixed at arrival and the sorted lists stay sorted without re-sorting.

Bound on waiting (aging_rate r > 0, priorities in [lo, hi]): a request R with priority p that
arrived at step a is outranked only by requests that arrived before step a + (p - lo) / r, a
finite set; everything newer ranks below R. Once that set is served R is the top-ranked
unprotected request: admission takes it first, and under "priority" it preempts lower-ranked
running sequences to get a slot and pages. tests/test_scheduler_policy.py checks the bound.

Fair sharing (`fair_share`): each tenant has a service counter, the step tokens its sequences
were given divided by its weight (a deficit count over tokens, as in weighted deficit round
robin). Admission takes the next sequence (in key order within its tenant) of the active
tenant with the smallest counter, so a tenant flooding the queue gets its share and no more
while another is active. A tenant that becomes active starts at the smallest counter of the
active tenants (idle time banks no credit). Protected sequences still go first.

Only the counters' order among active tenants matters, so an idle tenant's counter is kept
only while it is debt: above the smallest active counter, which it would otherwise be raised
to on its return. Once the active tenants' counters pass it (the smallest active counter never
falls while some tenant is active: newcomers start at it), forgetting it changes nothing, and
when no tenant is active at all every counter is forgotten (the server went idle: like WFQ's
virtual time, service restarts from zero). So the map holds the active tenants plus the idle
ones still in debt, not every tenant ever named (clients may name new ones at will).
"""

from __future__ import annotations

from jaxserve.config import SchedulerConfig
from jaxserve.scheduler.sequence import Sequence


def sort_key(cfg: SchedulerConfig, seq: Sequence) -> tuple:
    protected = seq.num_preemptions >= cfg.max_preemptions_per_request
    eff = 0.0
    if cfg.scheduling_policy == "priority":
        eff = seq.request_priority + cfg.priority_aging_rate * seq.arrival_step
    return (0 if protected else 1, eff, seq.arrival_index, seq.sample_index)


class FairShare:
    """Per-tenant token service counters (see the module docstring)."""

    def __init__(self, weights: tuple[tuple[str, float], ...] = ()):
        self.weights = dict(weights)
        self.service: dict[str, float] = {}
        self.live: dict[str, int] = {}  # live sequences per tenant: the active tenants
        self._swept_at = 0  # len(service) after the last pass of _forget_paid_up

    def activate(self, tenant: str, n: int) -> None:
        if not self.live.get(tenant):
            active = [self.service[t] for t, c in self.live.items() if c > 0]
            floor = min(active) if active else 0.0
            self.service[tenant] = max(self.service.get(tenant, 0.0), floor)
        self.live[tenant] = self.live.get(tenant, 0) + n

    def retire(self, tenant: str) -> None:
        self.live[tenant] -= 1
        if self.live[tenant] == 0:
            del self.live[tenant]
            self._forget_paid_up()

    def _forget_paid_up(self) -> None:
        """Drop idle tenants' counters that carry no debt (see the module docstring). A full
        pass runs when the map has doubled since the last one, so it costs O(1) amortized."""
        if not self.live:
            self.service.clear()
            self._swept_at = 0
            return
        if len(self.service) < 2 * max(self._swept_at, len(self.live), 8):
            return
        floor = min(self.service[t] for t in self.live)
        self.service = {t: v for t, v in self.service.items() if t in self.live or v > floor}
        self._swept_at = len(self.service)

    def charge(self, tenant: str, tokens: int) -> None:
        self.service[tenant] = self.service.get(tenant, 0.0) + tokens / self.weights.get(tenant, 1.0)

    def order(self, waiting: list[Sequence]) -> list[Sequence]:
        """`waiting` (sorted by key) in admission order: protected first, then round by round
        the head of the tenant with the least service, service projected by each pick's prompt
        so one step's admissions alternate too."""
        out = [s for s in waiting if s.priority[0] == 0]
        heads: dict[str, list[Sequence]] = {}
        for s in waiting:
            if s.priority[0] != 0:
                heads.setdefault(s.tenant, []).append(s)
        projected = {t: self.service.get(t, 0.0) for t in heads}
        idx = {t: 0 for t in heads}
        while heads:
            t = min(heads, key=lambda t: (projected[t], heads[t][idx[t]].priority))
            s = heads[t][idx[t]]
            out.append(s)
            projected[t] += s.num_uncomputed_tokens / self.weights.get(t, 1.0)
            idx[t] += 1
            if idx[t] == len(heads[t]):
                del heads[t]
        return out
