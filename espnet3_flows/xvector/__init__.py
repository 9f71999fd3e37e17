"""Speaker-embedding (x-vector) extraction: speechbrain, ESPnet-SPK and RawNet3 models, exact
length-sorted batching, ESPnet2 output layouts.

The names below are imported on first use (importing the package imports no torch).
"""

from __future__ import annotations

from espnet3_flows.lazy_exports import lazy_getattr

_EXPORTS = {
    **dict.fromkeys(["EmbeddingModel", "XVectorModelError", "embed_waveforms", "length_sorted_batches",
                     "load_speechbrain_encoder", "speechbrain_embedder", "validate_device"],
                    "espnet3_flows.xvector.model"),
    **dict.fromkeys(["espnet_embedder", "load_espnet_spk_model", "resolve_espnet_model"],
                    "espnet3_flows.xvector.espnet_spk"),
    **dict.fromkeys(["RecipeRawNet3", "load_recipe_rawnet3", "rawnet_embedder", "recipe_windows"],
                    "espnet3_flows.xvector.rawnet3"),
    **dict.fromkeys(["speaker_means", "write_speaker_xvector_ark_scp", "write_utterance_tensors",
                     "write_xvector_ark_scp"], "espnet3_flows.xvector.outputs"),
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
