"""The ``xvector:`` section and what a speaker-embedding toolkit declares: :class:`XVectorConfig`,
:class:`XVectorToolkit` and the :data:`TOOLKITS` registry.

The section is checked against the registered toolkits, and each toolkit reads the section, so
the two live here together, below the job and the toolkits. A toolkit is a
:class:`XVectorToolkit` registered under its name. Each built-in one is declared in a module of
:mod:`espnet3_flows.xvector.toolkits` (named in :data:`BUILTIN_TOOLKIT_CLASSES`, loaded by the
registry on first use), which names the module of its implementation (imported on a worker only: these declarations import no torch): ``speechbrain``,
``espnet``, ``rawnet`` and ``custom``. Another package adds one through the entry-point group
``espnet3_flows.xvector_toolkits`` (``name = "package.module:MyToolkit"``, a subclass or an
instance); ``xvector.toolkit: <name>`` then runs it (``docs/plugins.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from collections.abc import Mapping

from espnet3_flows.code_keys import CODE, TARGET_WHY, when
from espnet3_flows.frontends.precision import PRECISIONS
from espnet3_flows.inputs.audio_config import RESAMPLERS
from espnet3_flows.registry import Registry, instance_of


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
    #: whether a config naming no manifest and no model runs the generated demo (a random-weight
    #: model of this toolkit on generated audio: :data:`~espnet3_flows.xvector.job_config.DEMO_WARNING`)
    has_demo: ClassVar[bool] = False
    #: whether its ``pretrained_model`` is data only (weights loaded with ``weights_only=True``,
    #: a config read with ``yaml.safe_load`` that picks registered classes): a deployment's form
    #: may then name it (:mod:`espnet3_flows.code_keys`)
    model_is_data: ClassVar[bool] = False

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


#: The built-in ``xvector.toolkit`` values and their classes, as an entry point names one, in the
#: order the UI's drop-down and the docs list them (a plugin adds others: :data:`TOOLKITS`)
BUILTIN_TOOLKIT_CLASSES = {
    "speechbrain": "espnet3_flows.xvector.toolkits.speechbrain:SpeechbrainToolkit",
    "espnet": "espnet3_flows.xvector.toolkits.espnet:EspnetToolkit",
    "rawnet": "espnet3_flows.xvector.toolkits.rawnet:RawnetToolkit",
    "custom": "espnet3_flows.xvector.toolkits.custom:CustomToolkit",
}
BUILTIN_TOOLKITS = tuple(BUILTIN_TOOLKIT_CLASSES)
#: every ``xvector.toolkit`` by name: the built-in ones, then the installed packages'
TOOLKITS: Registry[XVectorToolkit] = Registry("x-vector toolkit", "xvector.toolkit", accept=instance_of(XVectorToolkit),
                                              builtins=BUILTIN_TOOLKIT_CLASSES)


def model_builds_objects(xv: Mapping[str, Any]) -> bool:
    """Whether the ``pretrained_model`` of an ``xvector:`` section (as given: a mapping) can build
    Python objects, so a deployment's form may not name it: yes unless its toolkit's
    :attr:`~XVectorToolkit.model_is_data` (an unknown toolkit: yes)."""
    name = xv.get("toolkit") or XVectorConfig.__dataclass_fields__["toolkit"].default
    return not (name in TOOLKITS and TOOLKITS.get(name).model_is_data)


@dataclass
class XVectorConfig:
    """The ``xvector:`` section (names as in ESPnet3's x-vector recipe and ESPnet's
    ``extract_spk_embed.py``).

    Attributes:
        toolkit: ``speechbrain`` (an ``EncoderClassifier``), ``espnet`` (an ESPnet-SPK model, as
            ``espnet2.bin.spk_inference.Speech2Embedding`` runs it: ``spk_embed_tool=espnet`` of
            ``tts.sh``), ``rawnet`` (the recipe's RawNet3: ten 3-s windows averaged) or ``custom``
            (``model`` below), or a toolkit an installed plugin registers (entry points
            ``espnet3_flows.xvector_toolkits``: ``docs/plugins.md``). The default stays
            ``speechbrain`` (ESPnet's recipes default to ``espnet``: set it).
        pretrained_model: ``speechbrain``: a local model directory (``hyperparams.yaml`` and
            checkpoints) or a hub id already cached locally. ``espnet``: a ``.pth`` with its
            training ``config.yaml`` beside it, a directory holding them (or an unpacked model
            with ``meta.yaml``), or a model tag (``espnet/voxcelebs12_rawnet3``) already in the
            local Hugging Face cache. ``rawnet``: the RawNet3 weights file
            (``tools/RawNet/python/RawNet3/models/weights/model.pt``). Nothing is downloaded.
        model: For ``toolkit: custom``: ``{_target_: pkg.factory, ...}`` building a callable
            ``(wavs [B,T] float32, wav_lens [B] relative) -> [B, D]`` embeddings.
        device: ``cpu``, ``cuda`` or ``cuda:N``. On ``parallel.env: local_gpu`` each worker
            sees only its own GPU, so ``cuda`` is that worker's GPU.
        precision: ``float32`` (the default: exact float32, TF32 off also on a GPU), ``tf32``,
            ``bf16`` or ``fp16``: the model runs in that arithmetic
            (``espnet3_flows.frontends.precision``); faster on a GPU, embeddings that differ from
            float32's by the cosine the ``gpu`` benchmark states. Its shards have other hashes.
        spk_embed_tag: Names the outputs as ESPnet2's ``extract_xvectors.py`` /
            ``extract_spk_embed.py`` do: they go to ``{output_dir}/{tag}/{split}/`` as
            ``{tag}.{ark,scp}`` and ``spk_{tag}.{ark,scp}``. Empty: ``espnet_spk`` (``tts.sh``'s
            name) for ``espnet`` and ``rawnet``, ``xvector`` for ``speechbrain`` and ``custom``.
        save_path: ESPnet3's name of ``output_dir`` (an alias: give either; both set to
            different places is an error).
        batch_size: Utterances per model call, length-sorted within a shard; 0 picks 1 on CPU
            (batching does not pay there: measured 0.7x) and 16 on CUDA. Every toolkit but
            ``custom`` gives each utterance of a batch the embedding it gets alone.
        max_padded_samples: Optional cap on ``batch × longest`` samples per model call.
        sampling_rate: The model's rate; other audio is resampled (``rawnet``: 16000 only).
        resampler: ``poly`` (scipy, exact ratio), ``librosa`` (``librosa.resample``, as
            ``extract_spk_embed.py``) or ``torchaudio`` (as ``extract_spk_embed_parallel.py``);
            empty: ``librosa`` for ``espnet`` and ``rawnet``, ``poly`` for the others.
        channel: Channel of multi-channel audio; ``null`` averages (as ESPnet's extractor does).
        max_duration: Longest accepted recording in seconds (checked from the header).
        manifest_paths: ESPnet3's name of ``manifests`` (an alias: give either; both set to
            different manifests is an error).
        splits: Splits to process; empty means every split in ``manifests``.
        savedir: Where speechbrain links the model files (by default a temporary directory,
            removed once the model is loaded).
    """

    toolkit: str = field(default="speechbrain", metadata={"choices": BUILTIN_TOOLKITS, "registry": TOOLKITS})
    pretrained_model: str = field(default="", metadata={CODE: when(
        model_builds_objects,
        "its model files build Python objects (speechbrain's hyperparams.yaml, a plugin's loader)")})
    model: dict[str, Any] = field(default_factory=dict, metadata={CODE: TARGET_WHY})
    device: str = "cpu"
    precision: str = field(default="float32", metadata={"choices": PRECISIONS})
    spk_embed_tag: str = ""
    save_path: str = ""
    batch_size: int = 0
    max_padded_samples: int | None = None
    sampling_rate: int = 16000
    resampler: str = field(default="", metadata={"choices": ("", *RESAMPLERS)})
    channel: int | None = None
    max_duration: float | None = 3600.0
    manifest_paths: dict[str, str] = field(default_factory=dict)
    splits: list[str] = field(default_factory=list)
    savedir: str = ""

    @property
    def kit(self) -> XVectorToolkit:
        """The registered :class:`XVectorToolkit` of ``toolkit``."""
        return TOOLKITS.get(self.toolkit)
