"""Driver-side checks shared by every job, before any cluster starts (jobs come from
:mod:`espnet3_flows.job_registry`)."""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from espnet3_flows.config import ConfigError, load_config, merge_config, to_plain
from espnet3_flows.job_registry import JobSpec, get_job

__all__ = ["JobSpec", "check_output_dir", "get_job", "merged_data", "preflight", "resolve_config"]


def resolve_config(job: str, config_file: str | None, params: dict[str, Any], overrides: Sequence[str],
                   check: Callable[[Any], None] | None = None) -> Any:
    """Defaults < ``config_file`` < typed parameters that differ from their defaults < ``overrides``.

    ``params`` are dotted keys (see :func:`~espnet3_flows.orchestration.parameters.dotted_values`).

    A config that names no input runs the job's demo (generated data; for x-vectors also a
    random-weight model). ``check``, if given, is called with the merged config before that
    demo writes anything (a deployment's run refuses paths in a directory its worker deletes).
    """
    spec = get_job(job)
    schema = spec.config_class
    cfg = load_config(schema, config_file, overrides, params=_changed(schema, params))
    if check is not None:
        check(cfg)
    demo = spec.demo_settings(cfg)
    if demo:
        cfg = load_config(schema, base=OmegaConf.to_container(OmegaConf.merge(to_plain(cfg), demo)))
    return cfg


def merged_data(job: str, config_file: str | None, params: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """The plain data :func:`resolve_config` would validate for these sources (same layering),
    interpolations resolved, before any check runs (so before anything it names is imported)."""
    schema = get_job(job).config_class
    merged = merge_config(schema, config_file, overrides, params=_changed(schema, params))
    try:
        return OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"invalid configuration: {' '.join(str(exc).split())}") from None


def _changed(schema: type, params: dict[str, Any]) -> dict[str, Any]:
    """The typed parameters that differ from their defaults (a form sends every key)."""
    if not params:  # a command line's (its schema's defaults are not built for nothing)
        return {}
    defaults = OmegaConf.to_container(OmegaConf.structured(schema))
    return {k: v for k, v in params.items() if _lookup(defaults, k) != v}


def _lookup(d: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return object()
        d = d[part]
    return d


def check_output_dir(output_dir: str, storage_options: dict[str, Any]) -> None:
    """Fail before any work when the output location cannot be written."""
    from espnet3_flows.storage import Storage  # (fsspec: not before a command line's config is read)

    Storage(output_dir, storage_options).check_writable()


def preflight(job: str, cfg: Any, *, output: bool = True) -> None:
    """Everything checkable on the driver before any cluster starts: the output location is
    writable (unless ``output`` is False: a dry run writes nothing) and the job's own checks
    (x-vectors: the model loads from local files)."""
    if output:
        check_output_dir(cfg.output_dir, cfg.storage_options)
    get_job(job).run_preflight(cfg)
