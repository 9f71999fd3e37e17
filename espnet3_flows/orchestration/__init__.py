"""Prefect orchestration of the engine's jobs (the only package that imports prefect)."""
