"""The ``xvector.toolkit`` registry: what a speaker-embedding toolkit declares, and :data:`TOOLKITS`.

A toolkit is a :class:`XVectorToolkit` registered under its name. The built-in ones are declared
here, each naming the module of its implementation (imported on a worker only: these
declarations import no torch): ``speechbrain`` (:mod:`.model`), ``espnet`` (:mod:`.espnet_spk`),
``rawnet`` (:mod:`.rawnet3`) and ``custom``. Another package adds one through the entry-point
group ``espnet3_flows.xvector_toolkits`` (``name = "package.module:MyToolkit"``, a subclass or an
instance); ``xvector.toolkit: <name>`` then runs it (``docs/plugins.md``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from espnet3_flows.config import ConfigError, check_targets, instantiate
from espnet3_flows.registry import Registry, instance_of

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

    def check(self, xv: "XVectorConfig") -> None:
        """Check ``xv``'s options for this toolkit (raise :class:`ConfigError`)."""

    def check_installed(self, xv: "XVectorConfig") -> None:
        """On the driver before any cluster: what the toolkit needs is installed (raise :class:`ConfigError`)."""

    def model_files(self, xv: "XVectorConfig") -> tuple[Path, list[Path], bool]:
        """``(root, the files that make the model, whether it is a hub-cache snapshot)`` for a
        toolkit with a ``model_kind``; raise ``XVectorModelError`` when they are missing."""
        raise NotImplementedError

    def hashed(self, xv: "XVectorConfig") -> dict[str, Any]:
        """What of the toolkit decides the embeddings besides its name, ``model`` and the model's
        files, for the shard hashes."""
        return {"version": self.version} if self.version else {}

    def embedder(self, xv: "XVectorConfig") -> Any:
        """The embedding callable, built once per worker on ``xv.device``."""
        raise NotImplementedError


class SpeechbrainToolkit(XVectorToolkit):
    """``speechbrain``: an ``EncoderClassifier`` from a local model directory (:mod:`.model`)."""

    name = "speechbrain"
    model_kind = "a local speechbrain model directory"

    def model_files(self, xv: "XVectorConfig") -> tuple[Path, list[Path], bool]:
        from espnet3_flows.xvector.model import resolve_model_source

        root = resolve_model_source(xv.pretrained_model)
        return root, sorted(p for p in root.rglob("*") if p.is_file()), not Path(xv.pretrained_model).expanduser().is_dir()

    def hashed(self, xv: "XVectorConfig") -> dict[str, Any]:
        return {}

    def embedder(self, xv: "XVectorConfig") -> Any:
        import tempfile

        from espnet3_flows.xvector.model import load_speechbrain_encoder, speechbrain_embedder

        savedir = xv.savedir or tempfile.mkdtemp(prefix="espnet3-speechbrain-")
        return speechbrain_embedder(load_speechbrain_encoder(xv.pretrained_model, savedir, xv.device))


class _EspnetSpeakerTask(XVectorToolkit):
    """A toolkit that runs ESPnet's speaker task (its release is hashed into the shards)."""

    default_tag = "espnet_spk"  # tts.sh's name
    default_resampler = "librosa"  # as ESPnet's extract_spk_embed.py resamples

    def check_installed(self, xv: "XVectorConfig") -> None:
        from espnet3_flows.xvector.espnet_spk import install_hint, missing_spk_modules

        missing = missing_spk_modules()
        if missing:
            raise ConfigError(f"xvector.toolkit={xv.toolkit} needs ESPnet's speaker task, which is not installed "
                              f"(no {', '.join(missing)}): {install_hint()}")

    def hashed(self, xv: "XVectorConfig") -> dict[str, Any]:
        from espnet3_flows.frontends.espnet2_frontend import espnet_version

        return {"espnet": espnet_version()}


class EspnetToolkit(_EspnetSpeakerTask):
    """``espnet``: an ESPnet-SPK model, as ``espnet2.bin.spk_inference.Speech2Embedding`` runs it."""

    name = "espnet"
    model_kind = "an ESPnet-SPK .pth with its config.yaml, a model directory, or a cached model tag"

    def model_files(self, xv: "XVectorConfig") -> tuple[Path, list[Path], bool]:
        from espnet3_flows.xvector.espnet_spk import resolve_espnet_model

        files = resolve_espnet_model(xv.pretrained_model)
        return files.root, [files.config, files.weights], not Path(xv.pretrained_model).expanduser().exists()

    def embedder(self, xv: "XVectorConfig") -> Any:
        from espnet3_flows.xvector.espnet_spk import espnet_embedder, load_espnet_spk_model

        return espnet_embedder(load_espnet_spk_model(xv.pretrained_model, xv.device))


class RawnetToolkit(_EspnetSpeakerTask):
    """``rawnet``: the recipe's RawNet3 (ten 3-s windows averaged)."""

    name = "rawnet"
    model_kind = "the RawNet3 weights file"

    def check(self, xv: "XVectorConfig") -> None:
        if xv.sampling_rate != 16000:
            raise ConfigError(f"xvector.sampling_rate must be 16000 for toolkit rawnet (RawNet3's 3-s windows "
                              f"are at 16 kHz), got {xv.sampling_rate}")

    def model_files(self, xv: "XVectorConfig") -> tuple[Path, list[Path], bool]:
        from espnet3_flows.xvector.model import XVectorModelError

        local = Path(xv.pretrained_model).expanduser()
        if not local.is_file():
            raise XVectorModelError(f"RawNet3 weights file {xv.pretrained_model!r} does not exist (the recipe's "
                                    "tools/RawNet/python/RawNet3/models/weights/model.pt)")
        return local.parent, [local], False

    def embedder(self, xv: "XVectorConfig") -> Any:
        from espnet3_flows.xvector.rawnet3 import load_recipe_rawnet3, rawnet_embedder

        return rawnet_embedder(load_recipe_rawnet3(xv.pretrained_model, xv.device))


class CustomToolkit(XVectorToolkit):
    """``custom``: the callable ``xvector.model`` builds (``{_target_: pkg.factory, ...}``)."""

    name = "custom"

    def check(self, xv: "XVectorConfig") -> None:
        if "_target_" not in xv.model:
            raise ConfigError("xvector.toolkit=custom needs xvector.model._target_")
        check_targets(xv.model, "xvector.model")

    def hashed(self, xv: "XVectorConfig") -> dict[str, Any]:
        return {}

    def embedder(self, xv: "XVectorConfig") -> Any:
        return instantiate(xv.model, "xvector.model")


def _builtin_toolkits() -> None:
    for toolkit in (SpeechbrainToolkit(), EspnetToolkit(), RawnetToolkit(), CustomToolkit()):
        TOOLKITS.register(toolkit.name, toolkit)


#: every ``xvector.toolkit`` by name: the built-in ones, then the installed packages'
TOOLKITS: Registry[XVectorToolkit] = Registry("x-vector toolkit", "xvector.toolkit", builtins=_builtin_toolkits,
                                              accept=instance_of(XVectorToolkit))
