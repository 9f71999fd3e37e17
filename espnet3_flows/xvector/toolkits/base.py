"""What a speaker-embedding toolkit declares: :class:`XVectorToolkit`. A declaration imports no
torch (the driver reads it to check a config); its embedder is built on a worker only."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from espnet3_flows.xvector.job import XVectorConfig


class XVectorToolkit:
    """One ``xvector.toolkit``: its defaults, its checks on the driver, the files its model is
    loaded from (fingerprinted into the shard hashes), and the embedder a worker builds once.

    Subclass, set ``name`` (and ``version``, hashed into its shards) and override
    :meth:`embedder`. The embedder is called with ``(wavs [B, T] float32 tensor, wav_lens [B]
    relative lengths)`` and returns ``[B, D]`` embeddings; each utterance of a batch should get
    the embedding it gets alone (batches are length-sorted, padded with zeros).
    """

    #: the ``xvector.toolkit`` it is registered as
    name: ClassVar[str] = ""
    #: hashed into every shard it computes: change it when its embeddings change
    version: ClassVar[str] = ""
    #: what ``xvector.pretrained_model`` names (empty: it needs none)
    model_kind: ClassVar[str] = ""
    #: ``spk_embed_tag`` when none is given
    default_tag: ClassVar[str] = "xvector"
    #: ``resampler`` when none is given
    default_resampler: ClassVar[str] = "poly"

    def __repr__(self) -> str:
        return f"<x-vector toolkit {self.name!r}>"

    def check(self, xv: XVectorConfig) -> None:
        """Check ``xv``'s options for this toolkit (raise :class:`ConfigError`)."""

    def check_installed(self, xv: XVectorConfig) -> None:
        """On the driver before any cluster: what the toolkit needs is installed (raise :class:`ConfigError`)."""

    def model_files(self, xv: XVectorConfig) -> tuple[Path, list[Path], bool]:
        """``(root, the files that make the model, whether it is a hub-cache snapshot)`` for a
        toolkit with a ``model_kind``; raise ``XVectorModelError`` when they are missing."""
        raise NotImplementedError

    def hashed(self, xv: XVectorConfig) -> dict[str, Any]:
        """What of the toolkit decides the embeddings besides its name, ``model`` and the model's
        files, for the shard hashes."""
        return {"version": self.version} if self.version else {}

    def embedder(self, xv: XVectorConfig) -> Any:
        """The embedding callable, built once per worker on ``xv.device``."""
        raise NotImplementedError
