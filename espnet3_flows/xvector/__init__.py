"""Speaker-embedding (x-vector) extraction: models, length-sorted batching, ESPnet2 output layouts."""

from .model import (
    EmbeddingModel,
    XVectorModelError,
    embed_waveforms,
    length_sorted_batches,
    load_speechbrain_encoder,
    speechbrain_embedder,
    validate_device,
)
from .outputs import (
    relocate_scp,
    speaker_means,
    write_speaker_xvector_ark_scp,
    write_utterance_tensors,
    write_xvector_ark_scp,
)

__all__ = [
    "EmbeddingModel",
    "XVectorModelError",
    "embed_waveforms",
    "length_sorted_batches",
    "load_speechbrain_encoder",
    "relocate_scp",
    "speaker_means",
    "speechbrain_embedder",
    "validate_device",
    "write_speaker_xvector_ark_scp",
    "write_utterance_tensors",
    "write_xvector_ark_scp",
]
