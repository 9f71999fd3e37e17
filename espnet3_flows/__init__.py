"""espnet3-flows: resumable, sharded speech-data jobs orchestrated by Prefect on Dask."""

__version__ = "0.1.0"
