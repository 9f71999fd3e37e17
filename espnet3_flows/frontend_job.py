"""What the jobs whose workers run a frontend (collect-stats, extract-features) share: the
worker's env (the audio settings and the frontend, built once per worker) and a runner base
whose forked local workers preload the frontend's modules."""

from __future__ import annotations

from typing import Any, Callable

from espnet3_flows.frontends.frontend import build_frontend, frontend_modules
from espnet3_flows.utterance_job import JobEnvProvider, UtteranceRunner, audio_env


def frontend_env(cfg: Any) -> dict[str, Any]:
    """``audio``, ``storage_options`` and ``frontend`` for ``cfg.frontend`` (its rate, channel,
    longest duration and device), built once per worker."""
    fe = cfg.frontend
    return {**audio_env(cfg, fe.sampling_rate, fe.channel, fe.max_duration, device=fe.device),
            "frontend": build_frontend(fe)}


class FrontendRunner(UtteranceRunner):
    """A runner of one split of a job with a ``frontend`` config: its env is ``build_env(cfg)``
    (a module-level function, :func:`frontend_env` and the job's own keys), its batches
    ``cfg.batch_size``.

    Args:
        cfg: The job's config (``manifests``, ``frontend``, ``batch_size`` and the engine's keys).
        split: The split this runner computes.
        build_env: The worker's env of ``forward``.
    """

    def __init__(self, cfg: Any, split: str, build_env: Callable[[Any], dict[str, Any]], **kwargs: Any):
        super().__init__(cfg, split, cfg.manifests[split], JobEnvProvider(cfg, build_env), batch_size=cfg.batch_size,
                         **kwargs)

    @property
    def worker_modules(self) -> tuple[str, ...]:  # type: ignore[override]
        """The frontend's modules (preloaded by forked local workers)."""
        return frontend_modules(self.cfg.frontend)
