"""Frontends: what turns an utterance's audio into features, shared by the jobs (collect-stats'
statistics and shapes, extract-features' arks).

- :mod:`~espnet3_flows.frontends.config`: ``FrontendConfig`` (the ``frontend:`` section) and
  ``FrontendType``, what a kind of frontend declares (the ``FRONTENDS`` registry);
- :mod:`~espnet3_flows.frontends.frontend`:
  ``build_frontend``, the callable a worker builds once; ``extract_features`` runs it over
  loaded utterances with the checks every job applies;
- :mod:`~espnet3_flows.frontends.fbank`: lhotse's fbank, batched and exact (``FastFbank``);
- :mod:`~espnet3_flows.frontends.espnet2_frontend`: ESPnet2's own frontends (``frontend.type: espnet2``);
- :mod:`~espnet3_flows.frontends.espnet2_default`: ESPnet2's ``default`` frontend, exact and faster
  (``FastDefaultFrontend``).

The names below are imported on first use (importing the package imports no numpy or torch).
"""

from __future__ import annotations

from espnet3_flows.lazy_exports import lazy_getattr

_EXPORTS = {
    "FrontendConfig": "espnet3_flows.frontends.config",
    "build_frontend": "espnet3_flows.frontends.frontend",
    "extract_features": "espnet3_flows.frontends.frontend",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
