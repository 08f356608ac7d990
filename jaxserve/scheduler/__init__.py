"""Pure host-Python scheduler of the paged-KV continuous-batching engine (no jax import).

The engine drives it once per step:

    seq_ids = sched.add_request(request_id, prompt_ids, params, eos_token_ids)   # or raises
    plan = sched.schedule()                     # StepPlan: tokens, positions, block tables
    sampled = run_model(plan)                   # {seq_id: token} for seqs with sample=True
    events = sched.update(plan, sampled)        # SeqEvent per sampled token / finish
    sched.finish_sequence(seq_id, reason)       # stop string matched on detokenized text
    sched.abort_request(request_id)             # cancel in any phase; pages freed at once

See scheduler.py for the batching, preemption and fairness policy.
"""

from jaxserve.scheduler.errors import InvariantViolation, PagePoolError, SchedulerError
from jaxserve.scheduler.page_pool import NULL_PAGE, PagePool
from jaxserve.scheduler.plan import ScheduledSeq, SeqEvent, StepPlan
from jaxserve.scheduler.scheduler import Scheduler
from jaxserve.scheduler.sequence import Sequence, SeqStatus

__all__ = [
    "InvariantViolation", "NULL_PAGE", "PagePool", "PagePoolError", "ScheduledSeq", "Scheduler",
    "SchedulerError", "SeqEvent", "SeqStatus", "Sequence", "StepPlan",
]
