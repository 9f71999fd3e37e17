"""The jobs the flows can run: each maps a config schema to one runner per split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from espnet3_flows.config import ConfigError
from espnet3_flows.demo import demo_manifests
from espnet3_flows.parallel.runner import BaseRunner
from espnet3_flows.storage import Storage


@dataclass(frozen=True)
class JobSpec:
    """A job: its config schema, how to build its runners (one per split, each planning from its
    manifest), and the modules its workers import (preloaded once for forked local workers)."""

    name: str
    schema: type
    runners: Callable[[Any], list[BaseRunner]]
    worker_modules: tuple[str, ...] = ()
    #: the job's own checks on the driver before any cluster starts (raise ConfigError)
    preflight: Callable[[Any], None] | None = None
    #: for a config that names no input: the settings of the generated demo, else None
    demo: Callable[[Any], dict[str, Any] | None] | None = None


def _collect_stats_runners(cfg: Any) -> list[BaseRunner]:
    from espnet3_flows.stats.job import CollectStatsRunner

    return [CollectStatsRunner(cfg, split) for split in cfg.manifests]


def _collect_stats_demo(cfg: Any) -> dict[str, Any] | None:
    if cfg.manifests:
        return None
    return {"manifests": demo_manifests(cfg.output_dir, cfg.demo_utterances)}


def _xvector_demo(cfg: Any) -> dict[str, Any] | None:
    from espnet3_flows.xvector.job import demo_settings

    return demo_settings(cfg)


def _xvector_preflight(cfg: Any) -> None:
    from espnet3_flows.xvector.job import check_model_source

    check_model_source(cfg.xvector)


def _xvector_runners(cfg: Any) -> list[BaseRunner]:
    from espnet3_flows.xvector.job import xvector_runners

    return xvector_runners(cfg)


def get_job(name: str) -> JobSpec:
    """The job registered under ``name`` (``collect_stats`` or ``extract_xvectors``)."""
    if name == "collect_stats":
        from espnet3_flows.stats.job import CollectStatsConfig

        return JobSpec(name, CollectStatsConfig, _collect_stats_runners,
                       ("numpy", "torch", "soundfile", "lhotse", "matplotlib.figure", "matplotlib.backends.backend_agg"),
                       demo=_collect_stats_demo)
    if name == "extract_xvectors":
        from espnet3_flows.xvector.job import XVectorJobConfig

        return JobSpec(name, XVectorJobConfig, _xvector_runners, ("numpy", "torch", "soundfile"), _xvector_preflight,
                       _xvector_demo)
    raise ConfigError(f"unknown job {name!r}")


def check_output_dir(output_dir: str, storage_options: dict[str, Any]) -> None:
    """Fail before any work when the output location cannot be written."""
    Storage(output_dir, storage_options).check_writable()


def preflight(job: str, cfg: Any, *, output: bool = True) -> None:
    """Everything checkable on the driver before any cluster starts: the output location is
    writable (unless ``output`` is False: a dry run writes nothing) and the job's own checks
    (x-vectors: the model loads from local files)."""
    if output:
        check_output_dir(cfg.output_dir, cfg.storage_options)
    spec = get_job(job)
    if spec.preflight is not None:
        spec.preflight(cfg)
