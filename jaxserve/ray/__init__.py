"""jaxserve on Ray Data (`pip install 'jaxserve[ray]'`): `Processor` runs a pool of jaxserve
engines as a map_batches stage (processor.py); rows.py is the row format, batch_job.py
`generate_batch.py --ray`. Ray is imported on first use of `Processor`, so the flags of
batch_job.py are there without Ray installed."""

__all__ = ["Processor"]


def __getattr__(name: str):
    if name == "Processor":
        from jaxserve.ray.processor import Processor
        return Processor
    raise AttributeError(f"module 'jaxserve.ray' has no attribute {name!r}")
