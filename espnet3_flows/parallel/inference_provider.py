"""ESPnet3's ``espnet3.parallel.inference_provider`` module path: :class:`InferenceProvider` (defined in
:mod:`.env_provider`)."""

from espnet3_flows.parallel.env_provider import InferenceProvider

__all__ = ["InferenceProvider"]
