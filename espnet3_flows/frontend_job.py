"""What the jobs whose workers run a frontend (collect-stats, extract-features) share: the
worker's resources (the audio settings and the frontend, built once per worker), a runner base
whose forked local workers preload the frontend's modules, and the count of the audio's native
rates with the warning when most of a split was recorded below the frontend's rate."""

from __future__ import annotations

import logging
from typing import Any
from collections.abc import Callable, Sequence

from espnet3_flows.frontends.frontend import build_frontend, frontend_modules
from espnet3_flows.parallel.base_runner import WHOLE_SHARD
from espnet3_flows.parallel.results import ShardResult
from espnet3_flows.inputs.audio_config import AudioConfig
from espnet3_flows.utterance_job import JobEnvProvider, UtteranceRunner, audio_resources, audio_settings

_LOG = logging.getLogger(__name__)


def frontend_resources(cfg: Any) -> dict[str, Any]:
    """``audio``, ``storage_options`` and ``frontend`` for ``cfg.frontend`` (its rate, channel,
    longest duration and device), built once per worker."""
    return {**audio_resources(cfg, **frontend_audio(cfg)), "frontend": build_frontend(cfg.frontend)}


def frontend_audio(cfg: Any) -> dict[str, Any]:
    """How ``cfg.frontend`` reads audio, as :func:`audio_resources` and :func:`audio_settings` take it."""
    fe = cfg.frontend
    return {"sampling_rate": fe.sampling_rate, "channel": fe.channel, "max_duration": fe.max_duration,
            "device": fe.device}


class FrontendRunner(UtteranceRunner):
    """A runner of one split of a job with a ``frontend`` config: its resources are
    ``build_resources(cfg)`` (a module-level function, :func:`frontend_resources` and the job's own
    keys), its batches ``cfg.batch_size``, or with ``whole_shard`` a whole shard per ``forward``
    call where the frontend makes batches of its own
    (:meth:`~espnet3_flows.frontends.config.FrontendType.own_batches`).

    Args:
        cfg: The job's config (``manifests``, ``frontend``, ``batch_size`` and the engine's keys).
        split: The split this runner computes.
        build_resources: Builds the worker's resources of ``forward`` (ESPnet3's "env").
        whole_shard: Whether ``forward`` may take a whole shard (a job that keeps no features of
            a call: their memory is the frontend's batches', not the shard's).
    """

    def __init__(self, cfg: Any, split: str, build_resources: Callable[[Any], dict[str, Any]],
                 whole_shard: bool = False, **kwargs: Any):
        batch_size = WHOLE_SHARD if whole_shard and cfg.frontend.kind.own_batches(cfg.frontend) else cfg.batch_size
        super().__init__(cfg, split, cfg.manifests[split], JobEnvProvider(cfg, build_resources), batch_size=batch_size,
                         **kwargs)

    def input_audio(self) -> tuple[str, AudioConfig]:
        return "frontend.sampling_rate", audio_settings(self.cfg, **frontend_audio(self.cfg))

    @property
    def worker_modules(self) -> tuple[str, ...]:  # type: ignore[override]
        """The frontend's modules (preloaded by forked local workers)."""
        return frontend_modules(self.cfg.frontend)


def count_native_rate(state: dict[str, Any], rate: int) -> None:
    """Count one utterance's recorded rate in a shard's state (``native_rates``: rate as text →
    utterances), which the shard's ``close_writers`` returns into its done record."""
    rates = state.setdefault("native_rates", {})
    rates[str(rate)] = rates.get(str(rate), 0) + 1


def low_rate_warning(split: str, rates: dict[str, int], n_utts: int, target: int) -> str | None:
    """A warning when most utterances were recorded below the frontend's rate and upsampled:
    their features are empty above half the native rate (e.g. 8 kHz audio at 16 kHz leaves mel
    bins ~65-79 of 80 at the log floor), which usually means the configured rate is wrong."""
    low = {int(r): n for r, n in rates.items() if int(r) < target}
    if not n_utts or 2 * sum(low.values()) <= n_utts:
        return None
    common = max(low, key=low.get)
    return (f"split {split}: {sum(low.values())} of {n_utts} utterances are recorded below frontend.sampling_rate="
            f"{target} Hz (native rates {', '.join(f'{r} Hz: {n}' for r, n in rates.items())}); upsampled audio has "
            f"no content above {common // 2} Hz, so the upper features are empty. If that is your data, set "
            f"frontend.sampling_rate={common}")


def native_rates_summary(split: str, results: Sequence[ShardResult], n_utts: int, target: int) -> dict[str, Any]:
    """The split's ``summary.json`` keys on its audio's rates: ``native_sampling_rates``
    (utterances per recorded rate, summed over the shards' done records) and, when most of the
    split was recorded below ``target``, ``warnings`` with :func:`low_rate_warning` (logged too:
    the console and, for deployments, the Prefect UI show it)."""
    rates: dict[str, int] = {}
    for r in results:  # done records written before native rates were counted have none
        for rate, count in (r.result.get("native_rates") or {}).items():
            rates[rate] = rates.get(rate, 0) + int(count)
    rates = {k: rates[k] for k in sorted(rates, key=int)}
    warning = low_rate_warning(split, rates, n_utts, target)
    if warning is None:
        return {"native_sampling_rates": rates}
    _LOG.warning(warning)
    return {"native_sampling_rates": rates, "warnings": [warning]}
