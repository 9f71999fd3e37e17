"""``xvector.toolkit: speechbrain``: an ``EncoderClassifier`` from a local model directory
(the implementation: :mod:`espnet3_flows.xvector.model`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from espnet3_flows.xvector.config import XVectorConfig, XVectorToolkit



class SpeechbrainToolkit(XVectorToolkit):
    """``speechbrain``: an ``EncoderClassifier`` from a local model directory (:mod:`.model`)."""

    name = "speechbrain"
    model_kind = "a local speechbrain model directory"
    has_demo = True  # a random-weight ECAPA-TDNN built in speechbrain's model directory layout

    def model_files(self, xv: XVectorConfig) -> tuple[Path, list[Path], bool]:
        from espnet3_flows.xvector.model import resolve_model_source

        root = resolve_model_source(xv.pretrained_model)
        return root, sorted(p for p in root.rglob("*") if p.is_file()), not Path(xv.pretrained_model).expanduser().is_dir()

    def hashed(self, xv: XVectorConfig) -> dict[str, Any]:
        return {}

    def embedder(self, xv: XVectorConfig) -> Any:
        import contextlib
        import tempfile

        from espnet3_flows.xvector.model import load_speechbrain_encoder, speechbrain_embedder

        # the links are read while the model loads, never after: a temporary directory goes with
        # the load (one was left per worker and run before, thousands after months of nightly runs)
        links = (contextlib.nullcontext(xv.savedir) if xv.savedir
                 else tempfile.TemporaryDirectory(prefix="espnet3-speechbrain-"))
        with links as savedir:
            return speechbrain_embedder(load_speechbrain_encoder(xv.pretrained_model, savedir, xv.device))
