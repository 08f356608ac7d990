"""Scheduler exceptions.

Client mistakes are `jaxserve.types.InvalidRequestError` (raised at admission). The classes
here mean a bug: in the engine's use of the scheduler (`SchedulerError`), in page bookkeeping
(`PagePoolError`), or a broken invariant found by a check (`InvariantViolation`).
"""

from __future__ import annotations


class SchedulerError(RuntimeError):
    """The scheduler was called out of order (e.g. `update` with a plan it did not just make)."""


class PagePoolError(RuntimeError):
    """A page was allocated beyond the free list, freed twice, shared while free, or is the null page."""


class InvariantViolation(AssertionError):
    """A consistency check of the scheduler or the page pool failed; the message says which."""
