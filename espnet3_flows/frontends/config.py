"""The ``frontend:`` section and what a kind of frontend declares: :class:`FrontendConfig`,
:class:`FrontendType`, the :data:`FRONTENDS` registry and the :class:`Frontend` a type builds.

The config is checked against the registered types when it is read, and each type reads the
config, so the two live here together, below everything else of the package. A kind of frontend
is a :class:`FrontendType` registered under its name. The built-in ones are one module each
(:mod:`.fbank_type`, :mod:`.model_type`, :mod:`.espnet2_type`, :mod:`.none_type`), named in
:data:`BUILTIN_FRONTENDS` and loaded by the registry on first use; another package adds one through the entry-point group ``espnet3_flows.frontends`` (``name =
"package.module:MyFrontendType"``, a subclass or an instance), and ``frontend.type: <name>`` then
runs it with ``frontend.conf`` as its options. ``docs/plugins.md`` shows one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol
from collections.abc import Mapping, Sequence

from espnet3_flows.inputs.audio_config import check_audio_settings
from espnet3_flows.code_keys import CODE, TARGET_WHY
from espnet3_flows.config import ConfigError, check_choices, check_device
from espnet3_flows.frontends.espnet2_frontend import ESPNET2_FRONTENDS
from espnet3_flows.frontends.precision import PRECISIONS
from espnet3_flows.registry import Registry, instance_of

if TYPE_CHECKING:
    import numpy as np


class Frontend(Protocol):
    """Turns a batch of waveforms into per-utterance feature matrices ``(frames, dim)``."""

    def __call__(self, waves: Sequence[np.ndarray], kwargs: Mapping[str, Any]) -> list[np.ndarray]: ...


class FrontendType:
    """One ``frontend.type``: how its options are checked, what of them the shard hashes cover,
    which modules its workers import, and how a worker builds it.

    Subclass, set ``name`` and ``version`` and override :meth:`build` (and what else differs).
    The frontend :meth:`build` returns is called with a call's waveforms (float32, mono, at
    ``frontend.sampling_rate``) and the model keyword arguments, and returns one ``(frames, dim)``
    float32 array per waveform (:class:`~espnet3_flows.frontends.config.Frontend`).
    """

    #: the ``frontend.type`` it is registered as
    name: ClassVar[str] = ""
    #: hashed into every shard it computes: change it when its features change
    version: ClassVar[str] = ""
    #: whether ``frontend.conf`` holds its options (a plugin's options go there)
    takes_conf: ClassVar[bool] = True
    #: whether it runs on ``frontend.device`` (else only ``cpu`` is accepted)
    takes_device: ClassVar[bool] = False
    #: whether it runs in ``frontend.precision`` (else only ``float32`` is accepted)
    takes_precision: ClassVar[bool] = False
    #: whether ``frontend.name``, ``espnet_config`` and ``espnet2_class`` (an ESPnet2 frontend's
    #: choice) are its options
    takes_espnet2_options: ClassVar[bool] = False
    #: whether it computes features (else only lengths: a job that writes features refuses it)
    computes_features: ClassVar[bool] = True

    def __repr__(self) -> str:
        return f"<frontend type {self.name!r}>"

    def check(self, cfg: FrontendConfig) -> None:
        """Check (and complete) ``cfg``'s options of this type on the driver; raise
        :class:`~espnet3_flows.config.ConfigError`."""

    def hashed(self, cfg: FrontendConfig, base: Mapping[str, Any]) -> dict[str, Any]:
        """What decides the features, for the shard hashes: ``base`` (type, sampling rate,
        channel, longest recording) and this type's options and version."""
        from espnet3_flows.config import to_plain

        return {**base, "conf": to_plain(cfg.conf), "implementation": f"{self.name}/{self.version}"}

    def modules(self, cfg: FrontendConfig) -> tuple[str, ...]:
        """Modules a worker imports to build it (forked local workers import them once)."""
        return (type(self).__module__,)

    def build(self, cfg: FrontendConfig) -> Frontend | None:
        """The frontend a worker builds once (``None``: lengths only, no features)."""
        raise NotImplementedError

    def label(self, cfg: FrontendConfig) -> str:
        """What the outputs call these features (a lhotse cut's feature ``type``): its name."""
        return self.name

    def frame_shift(self, cfg: FrontendConfig) -> float | None:
        """Seconds between frames of its features where ``cfg`` decides them; ``None`` where
        the frontend a worker builds does (a model's hop: :func:`~.wave_frontends.hop_samples`)."""
        return None

    def own_batches(self, cfg: FrontendConfig) -> str:
        """How the frontend batches the utterances it is handed: ``"padded"`` (length-sorted
        padded batches: which utterances share a batch may change the features), ``"gathered"``
        (batches that never change them, as fbank's gathered frames on a GPU) or ``""`` (one
        utterance at a time; the default). Where a job hands the features of a call to nobody
        (collect-stats without ``write_collected_feats``), a frontend with batches of its own
        gets a whole shard per ``forward`` call: full batches of utterances of nearly one length."""
        return ""


#: The built-in ``frontend.type`` values and their classes, as an entry point names one (a plugin
#: adds others: :data:`FRONTENDS`)
BUILTIN_FRONTENDS = {
    "fbank": "espnet3_flows.frontends.fbank_type:FbankType",
    "none": "espnet3_flows.frontends.none_type:NoFrontend",
    "model": "espnet3_flows.frontends.model_type:ModelType",
    "espnet2": "espnet3_flows.frontends.espnet2_type:Espnet2Type",
}
FRONTEND_TYPES = tuple(BUILTIN_FRONTENDS)
#: every ``frontend.type`` by name: the built-in ones, then the installed packages'
FRONTENDS: Registry[FrontendType] = Registry("frontend", "frontend.type", accept=instance_of(FrontendType),
                                             builtins=BUILTIN_FRONTENDS)


@dataclass
class FrontendConfig:
    """The ``frontend:`` section.

    Attributes:
        type: ``fbank`` (the default: lhotse's Kaldi-compatible log-mel ``Fbank``, computed by
            :class:`~espnet3_flows.frontends.fbank.FastFbank`: lhotse's framing, window and mel
            matrix in fewer passes, equal to ``Fbank.extract`` within 1e-6 and ~2x faster per
            core), ``none`` (lengths only: audio headers are read, nothing is decoded or
            extracted; ESPnet2's ``extract_feats_in_collect_stats=False``), ``model`` (any torch
            module built from ``model`` whose ``collect_feats(speech, speech_lengths, **kwargs)``
            returns ``{"feats": [B,T,D], "feats_lengths": [B]}``, as in ESPnet2/ESPnet3) or
            ``espnet2`` (ESPnet2's frontend by ``name``, configured as in an ``asr.yaml``:
            ``docs/configuration.md``, "ESPnet2 frontends"; ``default`` is computed exactly and faster unless
            ``espnet2_class``); or a type an installed plugin registers (entry points
            ``espnet3_flows.frontends``: ``docs/plugins.md``), with its options in ``conf``.
        sampling_rate: Rate audio is resampled to (exact polyphase) before feature extraction.
            When most of a split was recorded below it, the run warns with the fix
            (``native_sampling_rates`` in ``summary.json`` counts the recorded rates).
        num_mel_bins: Mel bins of the fbank.
        frame_shift: Frame shift in seconds.
        frame_length: Frame length in seconds.
        dither: Dither of the fbank; 0 keeps results deterministic.
        channel: Channel of multi-channel audio to use; ``null`` averages the channels.
        max_duration: Longest accepted recording in seconds, checked from its header before
            decoding.
        model: For ``type: model``: ``{_target_: package.Class, arg: value, ...}``, built by
            Hydra's ``instantiate`` (see ``type`` for what the module must provide).
        name: For ``type: espnet2``: an ``asr.yaml``'s ``frontend`` (``default``, ``s3prl``,
            ``fused``, ...); empty: the ``espnet_config``'s, else ``default``.
        conf: For ``type: espnet2``: an ``asr.yaml``'s ``frontend_conf`` (``n_fft``,
            ``hop_length``, ``n_mels``, ``fs``, ...); its keys override the ``espnet_config``'s.
            An ``fs`` sets ``sampling_rate``. For a plugin's type: its options.
        espnet_config: For ``type: espnet2``: a trained ESPnet2 model's ``config.yaml`` (path
            or URL) to read ``frontend`` and ``frontend_conf`` from.
        espnet2_class: For ``type: espnet2`` with ``name: default``: ``false`` (the default)
            computes ``DefaultFrontend``'s features (STFT, power, librosa's mel matrix, log) with
            :class:`~espnet3_flows.frontends.espnet2_default.FastDefaultFrontend`, this
            package's restatement of them from ``conf``: equal to ESPnet2's class within float32
            rounding (max 2e-6 on the log-mel values), ~3x faster per core, one utterance at a
            time, and its workers import neither ESPnet2 nor librosa. ``true`` runs ESPnet2's
            ``DefaultFrontend`` class itself. The class runs anyway on a GPU (``device`` not
            ``cpu``) and for ``conf`` options the fast path does not compute (``apply_stft:
            false``, ``onesided: false``, WPE or a beamformer in ``frontend_conf``, options of
            other ESPnet releases), the latter with one warning naming the option. Its shards
            have other hashes than the class's (the features differ in float32 rounding).
        device: ``cpu``, ``cuda`` or ``cuda:N`` (with ``parallel.env: local_gpu``, or SLURM with
            a GPU per job such as ``--gres=gpu:1``, ``cuda`` is the worker's own GPU:
            ``conf/stats_slurm_gpu.yaml``). For ``model`` and ``espnet2`` the model is loaded once
            per worker onto it. For ``fbank``, each ``forward`` call's utterances (collect-stats
            without written features: each shard's) are computed on it together, their frames
            gathered into matrices (no padding, so each utterance's features are its own: equal
            to the CPU's within float32 rounding, 1e-5).
        max_batch_samples: For ``model`` and ``espnet2``: 0 runs the model on one utterance at
            a time, so features never depend on padding (ESPnet2's padded batches shift the last
            frames of ``center=True`` STFTs); above 0, utterances are length-sorted within each
            ``forward`` call (collect-stats without written features: within each shard, so
            that batches are full) and padded into batches of at most this many samples (batch x
            longest), a batch a quarter full closing before 5 % of padding: faster on a GPU,
            features of the shorter utterances of a batch may differ in their last frames. Not
            used by ``default``'s fast path (always one utterance at a time on one CPU thread:
            padding would only add work). For ``fbank`` on a GPU: the most samples computed
            together (0: 16M, ~17 min of 16 kHz audio); batching never changes fbank features.
        precision: For ``model`` and ``espnet2``: ``float32`` (the default; exact float32, TF32
            off also on a GPU), ``tf32`` (float32 with a GPU's TF32 tensor cores), or ``bf16`` /
            ``fp16`` (the model under ``torch.autocast`` to that dtype): faster on a GPU, features
            that differ from float32's by the error the ``gpu`` benchmark states
            (``espnet3_flows.frontends.precision``). Its shards have other hashes than float32's.
        bucket_shapes: For padded batches (``model`` and ``espnet2`` with ``max_batch_samples``
            above 0): pad each batch to one of a few fixed shapes, its longest utterance up to a
            length on a ladder of 5 % steps (from 1,600 samples, in multiples of 160: 0.1 s and
            10 ms at 16 kHz) and its rows up to 1, 2, 4 or 8, above that to a multiple of a
            sixteenth of what that length holds (at least 8), rows of zeros computed and dropped
            (the frontend must give its features' lengths). A GPU then sees the same shapes call
            after call, so under ``bf16``/``fp16`` cuDNN's attention, which plans each new shape
            once (~200 ms), stays on. More padding (collect-stats' ``padding_fraction`` counts it): for shards of
            1,000 utterances of 2-16 s, 10 % at 16M samples (4.9 % without) and 5.5 % at 4M (1.9 %),
            91 shapes over 30 shards' 479 batches; a bad trade for calls of a few utterances (16:
            51 % against 28 %). Features as padded batches give them: for a padding-exact model
            (``SSLFeatures``) each utterance's alone within float rounding. Off by default (its
            gain on a GPU is not measured yet). Its shards have other hashes.
    """

    type: str = field(default="fbank", metadata={"choices": FRONTEND_TYPES, "registry": FRONTENDS})
    sampling_rate: int = 16000
    num_mel_bins: int = 80
    frame_shift: float = 0.01
    frame_length: float = 0.025
    dither: float = 0.0
    channel: int | None = None
    max_duration: float | None = 3600.0
    model: dict[str, Any] = field(default_factory=dict, metadata={CODE: TARGET_WHY})
    name: str = field(default="", metadata={"choices": ("", *ESPNET2_FRONTENDS)})
    conf: dict[str, Any] = field(default_factory=dict)
    espnet_config: str = ""
    espnet2_class: bool = False
    device: str = "cpu"
    max_batch_samples: int = 0
    precision: str = field(default="float32", metadata={"choices": PRECISIONS})
    bucket_shapes: bool = False

    def __post_init__(self) -> None:
        check_choices(self, "frontend.")
        kind = self.kind
        if not kind.takes_espnet2_options and (self.name or self.espnet_config or self.espnet2_class
                                               or (self.conf and not kind.takes_conf)):
            raise ConfigError(f"frontend.name, frontend.conf, frontend.espnet_config and frontend.espnet2_class are "
                              f"for {_types_that('takes_espnet2_options')}, not type={self.type}"
                              + (" (frontend.conf holds a plugin type's options)" if self.conf else ""))
        kind.check(self)
        check_device(self.device, "frontend.device")
        if self.device != "cpu" and not kind.takes_device:
            raise ConfigError(f"frontend.device={self.device} is for {_types_that('takes_device')} (type={self.type} "
                              "runs on the CPU only)")
        if self.precision != "float32" and not kind.takes_precision:
            raise ConfigError(f"frontend.precision={self.precision} is for {_types_that('takes_precision')} "
                              f"(type={self.type} computes in float32)")
        if self.max_batch_samples < 0:
            raise ConfigError(f"frontend.max_batch_samples must be >= 0, got {self.max_batch_samples}")
        if self.bucket_shapes and kind.own_batches(self) != "padded":
            raise ConfigError("frontend.bucket_shapes is for padded batches: type=model or espnet2 (not "
                              "espnet2's default fast path) with frontend.max_batch_samples above 0 (got "
                              f"type={self.type}, max_batch_samples={self.max_batch_samples})")
        if self.num_mel_bins <= 0:
            raise ConfigError(f"frontend.num_mel_bins must be positive, got {self.num_mel_bins}")
        try:
            check_audio_settings("frontend.", self.sampling_rate, self.channel, self.max_duration)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def kind(self) -> FrontendType:
        """The registered :class:`~espnet3_flows.frontends.config.FrontendType` of ``type``."""
        return FRONTENDS.get(self.type)

    def hashed(self) -> dict[str, Any]:
        """What of this section decides the features (the shard hashes' part): the keys of its
        type only, so that keys of other types (and ``device``) never recompute a shard."""
        base = {"type": self.type, "sampling_rate": self.sampling_rate, "channel": self.channel,
                "max_duration": self.max_duration}
        return self.kind.hashed(self, base)


def _types_that(flag: str) -> str:
    """``type=a, b or c``: the registered frontend types whose ``flag`` is set (for messages)."""
    names = [name for name, kind in FRONTENDS.items().items() if getattr(kind, flag)]  # (declared order)
    return "type=" + (", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names))
