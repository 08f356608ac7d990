"""jaxserve as a Ray Data stage: `Processor(...)(dataset)` -> a dataset of result rows.

    import ray, jaxserve.ray
    proc = jaxserve.ray.Processor(model="path/to/hf", max_num_seqs=32, concurrency=4,
                                  resources={"TPU": 4})          # one engine per TPU host
    out = proc(ray.data.read_parquet("gs://bucket/prompts/"))
    out.write_parquet("gs://bucket/results/")
    print(proc.summary())

The engine keywords are jaxserve.LLM's (the same config tree as every entry point), checked on
the driver before any actor starts. `concurrency` actors each run one engine over the devices Ray
gives them (`num_cpus`, `num_gpus`, `resources`: a TPU host's chips, a GPU, or CPU cores); Ray
feeds each actor `batch_size`-row batches, up to `max_concurrent_batches` at once, and the
actor's engine batches all of their rows continuously (stage.py).

What Ray guarantees, and what this stage adds: Ray Data restarts an actor that dies and re-runs
its unfinished tasks (its defaults: actors restart without limit, tasks retry); a task's output
rows are the same rows in the same order on every run (greedy rows and seeded sampled rows give
the same tokens on any actor), so a re-run task's output replaces the lost one instead of adding
to it, and the output has exactly one row per input row. An unseeded sampled row that is re-run
may sample another text: still one row. Rows the engine refuses, and malformed rows, come out as
error rows naming the field (rows.py); none is dropped.
"""

from __future__ import annotations

import warnings
from typing import Any

import ray

from jaxserve.engine.llm import llm_configs
from jaxserve.ray.stage import EngineStage, StatsActor

INPUT_FORMATS = ("rows", "jsonl")


class Processor:
    def __init__(self, *, concurrency: int = 1, batch_size: int = 16, max_concurrent_batches: int = 4,
                 num_cpus: float = 1, num_gpus: float = 0, resources: dict[str, float] | None = None,
                 runtime_env: dict | None = None, input_format: str = "rows", **llm_kwargs: Any):
        for name, v in (("concurrency", concurrency), ("batch_size", batch_size),
                        ("max_concurrent_batches", max_concurrent_batches)):
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if input_format not in INPUT_FORMATS:
            raise ValueError(f"input_format must be one of {INPUT_FORMATS}, got {input_format!r}")
        self.load, self.engine = llm_configs(**llm_kwargs)
        self.concurrency, self.batch_size = concurrency, batch_size
        self.max_concurrent_batches = max_concurrent_batches
        self.remote_args: dict[str, Any] = {"num_cpus": num_cpus}
        if num_gpus:
            self.remote_args["num_gpus"] = num_gpus
        if resources:
            self.remote_args["resources"] = resources
        if runtime_env:
            self.remote_args["runtime_env"] = runtime_env
        self.input_format = input_format
        self._stats = None

    def __call__(self, ds: "ray.data.Dataset") -> "ray.data.Dataset":
        self._warn_if_no_cpu_left()
        self._stats = StatsActor.remote()
        # Blocks of one batch each: Ray Data gives an actor whole blocks, so a dataset read as a
        # few large blocks (one JSONL file is one) would run on one actor however many there
        # are (measured: 2 actors, 2,000 rows of one file, one actor ran them all). A streaming
        # split: no shuffle, nothing materialised.
        ds = ds.repartition(target_num_rows_per_block=self.batch_size)
        return ds.map_batches(
            EngineStage,
            fn_constructor_kwargs=dict(load=self.load, engine=self.engine, input_format=self.input_format,
                                       stats=self._stats),
            batch_size=self.batch_size, batch_format="pyarrow",
            # Enough tasks in flight per actor to fill its concurrent batch calls (vLLM's
            # ray.data.llm does the same): the engine sees rows of several batches each step.
            compute=ray.data.ActorPoolStrategy(size=self.concurrency,
                                               max_tasks_in_flight_per_actor=2 * self.max_concurrent_batches,
                                               max_concurrent_calls_per_actor=self.max_concurrent_batches),
            **self.remote_args)

    def _warn_if_no_cpu_left(self) -> None:
        """Actors that reserve every CPU of the cluster leave none for Ray's read and write
        tasks, and the job waits forever; said before it starts (a warning, not an error: an
        autoscaling cluster may add nodes)."""
        if not ray.is_initialized():
            return
        total, wanted = ray.cluster_resources().get("CPU", 0), self.concurrency * self.remote_args["num_cpus"]
        if total - wanted < 1:
            warnings.warn(f"{self.concurrency} engine actors x num_cpus={self.remote_args['num_cpus']} reserve "
                          f"{wanted:g} of the cluster's {total:g} CPUs, leaving less than 1 for reading and "
                          "writing: the job waits until the cluster grows (lower num_cpus / --ray-num-cpus)",
                          stacklevel=3)

    def summary(self) -> dict[str, dict]:
        """Each engine actor's totals (pid, node, rows, errors, tokens, step_seconds,
        load_seconds, first_batch_at, last_batch_at), keyed by actor; {} before the dataset
        has run."""
        return {} if self._stats is None else ray.get(self._stats.totals.remote())
