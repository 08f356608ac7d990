"""The Ray Data stage: a callable class that Ray runs as a pool of actors, one jaxserve engine
each (`Processor` in processor.py builds the map_batches call).

Each actor loads the model and compiles its step programs once (`__init__`), then Ray calls the
async `__call__` with up to `max_concurrent_batches` batches at a time; their rows all go into
the one engine (engine_worker.py), so the engine stays full while Ray feeds it. A batch's output
has one row per input row in input order (a blank JSONL line is not a row), which is what Ray
Data's retries rely on: a task re-run after its actor died yields the same rows in the same
order, so Ray keeps exactly one copy of each.

`StatsActor` collects each engine actor's running totals (rows, errors, tokens, step seconds,
its pid, and when its first batch arrived and its last batch left, as Unix times, so a job's
generation window can be told from its start-up) for the job's summary; an actor that dies
keeps its last report under its own key.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import ray

from jaxserve.ray.rows import JSONL_COLUMN, to_table, work_of_jsonl_line, work_of_row


@ray.remote(num_cpus=0)
class StatsActor:
    def __init__(self):
        self.actors: dict[str, dict] = {}

    def report(self, key: str, totals: dict) -> None:
        self.actors[key] = totals

    def totals(self) -> dict[str, dict]:
        return dict(self.actors)


class EngineStage:
    def __init__(self, load, engine, input_format: str = "rows", stats=None):
        """load, engine: the LoadConfig and EngineConfig every actor builds its engine from (the
        driver checked them). input_format: "rows" (a dict of fields per row: Parquet, a
        Dataset from items) or "jsonl" (ray.data.read_text rows, one raw line each). stats: a
        StatsActor handle or None."""
        from jaxserve import LLM, flags
        from jaxserve.ray.engine_worker import EngineWorker

        t0 = time.perf_counter()
        self.llm = LLM(progress=False, **flags.llm_kwargs(load, engine))
        self.worker = EngineWorker(self.llm.engine)
        self.jsonl = input_format == "jsonl"
        self.stats = stats
        self.key = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.totals = {"pid": os.getpid(), "node": os.uname().nodename, "rows": 0, "errors": 0,
                       "tokens": 0, "step_seconds": 0.0, "load_seconds": time.perf_counter() - t0,
                       "first_batch_at": None, "last_batch_at": None}
        self._report()

    async def __call__(self, batch):
        if self.totals["first_batch_at"] is None:
            self.totals["first_batch_at"] = time.time()
        items = [work_of_jsonl_line(r[JSONL_COLUMN]) if self.jsonl else work_of_row(r) for r in batch.to_pylist()]
        items = [x for x in items if x is not None]
        futures = {i: asyncio.wrap_future(self.worker.submit(x)) for i, x in enumerate(items) if not isinstance(x, dict)}
        done = dict(zip(futures, await asyncio.gather(*futures.values())))
        records = [done.get(i, x) for i, x in enumerate(items)]
        t = self.totals
        t["rows"] += len(records)
        t["errors"] += sum("error" in r for r in records)
        t["tokens"], t["step_seconds"] = self.worker.tokens, round(self.worker.busy_seconds, 3)
        t["last_batch_at"] = time.time()
        self._report()
        return to_table(records)

    def _report(self) -> None:
        if self.stats is not None:
            self.stats.report.remote(self.key, dict(self.totals))
