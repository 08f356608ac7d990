"""Per-tenant limits, checked before a request is accepted (pure Python, clock injected).

A tenant is who the transport authenticated (server/tenancy.py: bearer token, client
certificate, or one anonymous tenant). Every tenant gets the same `TenantLimits`:

    max_concurrent       requests accepted and not yet ended
    max_queued           of those, requests still waiting for their first token
    tokens_per_minute    a token bucket over prompt + output tokens: capacity one minute's worth,
                         refilled continuously. A request is charged prompt + n * max_tokens on
                         admission (the most it can cost) and refunded the output it did not
                         generate when it ends, so a short answer costs only what it used.
    max_prompt_tokens    per request
    max_output_tokens    per request (max_tokens)

`check` returns a `Refusal` naming the limit, with `retry_after_s` for the limits that free up
with time (None for a request that can never pass, e.g. longer than max_prompt_tokens or
costing more tokens than the bucket holds: retrying would not help). 0 / None = unlimited.

Without --auth-token any client can name a new tenant, so a tenant's state is forgotten once
it is neutral: nothing live or queued and a full bucket, exactly what a tenant never seen
gets. Forgetting it then changes no decision (a returning tenant starts where it would have
been anyway) and keeps the map to the tenants with requests in flight plus those idle for
less than the minute a bucket takes to refill: idle tenants wait in `_idle` in the order
they went idle, and each call drops those idle for a minute or more (full by then).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class TenantLimits:
    max_concurrent: int = 0
    max_queued: int = 0
    tokens_per_minute: int = 0
    max_prompt_tokens: int = 0
    max_output_tokens: int = 0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"tenant {f.name}: must be an integer >= 0 (0 = unlimited), got {v!r}")

    @property
    def any(self) -> bool:
        return any(getattr(self, f.name) for f in dataclasses.fields(self))


@dataclasses.dataclass(frozen=True)
class Refusal:
    limit: str  # the TenantLimits field
    message: str
    retry_after_s: float | None  # None: retrying cannot help


@dataclasses.dataclass
class _Tenant:
    live: int = 0
    queued: int = 0
    tokens: float = 0.0  # bucket level
    stamp: float = 0.0  # when `tokens` was last refilled


class TenantQuotas:
    """Thread-safe: `check_and_reserve` runs on the event loop, `started` / `ended` may not."""

    def __init__(self, limits: TenantLimits, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._tenants: dict[str, _Tenant] = {}
        self._idle: OrderedDict[str, float] = OrderedDict()  # tenant -> when it went idle

    def _forget_refilled(self, now: float) -> None:
        """Drop the tenants idle for a minute or more: their buckets are full again."""
        while self._idle:
            name, since = next(iter(self._idle.items()))
            if now - since < 60.0:
                break
            del self._idle[name], self._tenants[name]

    def _tenant(self, name: str, now: float) -> _Tenant:
        self._forget_refilled(now)
        t = self._tenants.get(name)
        tpm = self.limits.tokens_per_minute
        if t is None:
            t = self._tenants[name] = _Tenant(tokens=float(tpm), stamp=now)
        elif tpm:
            t.tokens = min(float(tpm), t.tokens + (now - t.stamp) * tpm / 60.0)
            t.stamp = now
        return t

    def check_and_reserve(self, tenant: str, prompt_tokens: int, max_tokens: int, n: int = 1) -> Refusal | None:
        """Refuse (nothing reserved) or reserve a slot and the request's worst-case tokens."""
        lim = self.limits
        if lim.max_prompt_tokens and prompt_tokens > lim.max_prompt_tokens:
            return Refusal("max_prompt_tokens", f"prompt of {prompt_tokens} tokens is more than this "
                           f"tenant's max_prompt_tokens={lim.max_prompt_tokens}", None)
        if lim.max_output_tokens and max_tokens > lim.max_output_tokens:
            return Refusal("max_output_tokens", f"max_tokens={max_tokens} is more than this tenant's "
                           f"max_output_tokens={lim.max_output_tokens}", None)
        cost = prompt_tokens + n * max_tokens
        with self._lock:
            now = self._clock()
            t = self._tenant(tenant, now)
            refusal = self._check(t, cost)
            if refusal is None:
                self._idle.pop(tenant, None)  # in use again
                if lim.tokens_per_minute:
                    t.tokens -= cost
                t.live += 1
                t.queued += 1
            else:
                self._settle(tenant, t, now)
            return refusal

    def _check(self, t: _Tenant, cost: int) -> Refusal | None:
        lim = self.limits
        if lim.max_concurrent and t.live >= lim.max_concurrent:
            return Refusal("max_concurrent", f"this tenant has {t.live} requests in flight, its "
                           f"max_concurrent={lim.max_concurrent}; retry when one ends", 1.0)
        if lim.max_queued and t.queued >= lim.max_queued:
            return Refusal("max_queued", f"this tenant has {t.queued} requests waiting to start, "
                           f"its max_queued={lim.max_queued}; retry when one starts", 1.0)
        tpm = lim.tokens_per_minute
        if tpm and cost > tpm:
            return Refusal("tokens_per_minute", f"prompt + n * max_tokens = {cost} tokens is more "
                           f"than this tenant's tokens_per_minute={tpm}", None)
        if tpm and cost > t.tokens:
            wait = (cost - t.tokens) * 60.0 / tpm
            return Refusal("tokens_per_minute", f"this tenant's token bucket holds {int(t.tokens)} "
                           f"of the {cost} tokens this request may use (tokens_per_minute={tpm}); "
                           f"retry after {wait:.1f} s", wait)
        return None

    def started(self, tenant: str) -> None:
        """The request got its first token: it no longer counts as queued."""
        with self._lock:
            self._tenants[tenant].queued -= 1

    def ended(self, tenant: str, unused_tokens: int, was_queued: bool) -> None:
        """The request ended; `unused_tokens` of its reservation go back to the bucket."""
        with self._lock:
            now = self._clock()
            t = self._tenant(tenant, now)
            t.live -= 1
            if was_queued:
                t.queued -= 1
            if self.limits.tokens_per_minute:
                t.tokens = min(float(self.limits.tokens_per_minute), t.tokens + unused_tokens)
            if t.live < 0 or t.queued < 0:
                raise AssertionError(f"tenant counters went negative ({t.live} live, {t.queued} queued)")
            self._settle(tenant, t, now)

    def _settle(self, name: str, t: _Tenant, now: float) -> None:
        """After a call that leaves `name` with nothing live: forget it if neutral, else queue
        it to be forgotten once its bucket has surely refilled."""
        if t.live:
            return
        tpm = self.limits.tokens_per_minute
        if not tpm or t.tokens >= tpm:
            del self._tenants[name]
            self._idle.pop(name, None)
        elif name not in self._idle:  # a refused request keeps the time of the last use
            self._idle[name] = now  # `now` is the latest: _idle stays in time order

    def snapshot(self, tenant: str) -> tuple[int, int, float]:
        """(live, queued, bucket level) of `tenant`; a forgotten one's are the neutral ones."""
        with self._lock:
            now = self._clock()
            self._forget_refilled(now)
            t = self._tenants.get(tenant)
            if t is None:
                return 0, 0, float(self.limits.tokens_per_minute)
            tpm = self.limits.tokens_per_minute
            level = min(float(tpm), t.tokens + (now - t.stamp) * tpm / 60.0) if tpm else t.tokens
            return t.live, t.queued, level

    def __len__(self) -> int:
        """How many tenants' state is held (bounded: see the module docstring)."""
        with self._lock:
            return len(self._tenants)
