"""ESPnet2's ``DefaultFrontend`` (STFT, power, librosa's mel matrix, log) computed per utterance,
without ESPnet2 or librosa, in fewer passes: the same features to float32 rounding.

ESPnet2's class (``espnet2/asr/frontend/default.py`` with ``espnet2/layers/stft.py`` and
``log_mel.py``) spends more of a 4 s utterance around its arithmetic than in it: the STFT is
transposed twice, wrapped in a ``ComplexTensor``, squared as two strided halves, multiplied by a
dense 257x80 mel matrix (97 % zeros), and masked twice for padding that one utterance does not
have. This module frames the reflect-padded waveform as ``torch.stft`` does, takes the FFT with
the same torch call (the spectra are bit-identical), squares the interleaved real/imaginary pairs
in place and multiplies each band of mel filters by its own bins only. Its mel matrix is librosa's
``filters.mel`` (Slaney's scale or HTK's, Slaney's area normalization) restated in numpy, equal to
librosa's to the bit; building it imports neither librosa nor scipy nor numba, so a worker that
runs this needs only torch and numpy (``frontend_modules`` preloads exactly these).

What it covers, read from the frontend's own ``frontend_conf`` (:func:`read_default_conf`): ``fs``,
``n_fft``, ``win_length``, ``hop_length``, ``window`` (any torch window, or none), ``center``,
``normalized``, ``n_mels``, ``fmin``, ``fmax``, ``htk``, and ``frontend_conf`` (ESPnet's WPE and
beamformer front end) when it enables neither. Anything else (``apply_stft: false``,
``onesided: false``, WPE or a beamformer, an option of another ESPnet release) runs ESPnet2's own
class, with one warning naming the option. ``tests/frontends/test_espnet2_default.py`` checks
every covered option against ESPnet2's class; an ESPnet release not checked there is compared on
a probe signal when a worker builds the frontend (:func:`agrees_with_espnet2`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

import numpy as np
import numpy.fft  # numpy imports it on first use: here, once in the forkserver that preloads this

from espnet3_flows.config import ConfigError
from espnet3_flows.errors import BadItemError
from espnet3_flows.frontends.espnet2_frontend import espnet_version, parse_fs
from espnet3_flows.frontends.fbank import mel_bands

#: ESPnet releases whose ``DefaultFrontend`` the tests compared this module with (others are
#: compared on a probe signal in each worker before the fast path is used)
VERIFIED_ESPNET = ("202511",)
#: ``DefaultFrontend``'s keyword arguments and defaults (ESPnet 202511)
DEFAULTS: dict[str, Any] = {"fs": 16000, "n_fft": 512, "win_length": None, "hop_length": 128, "window": "hann",
                            "center": True, "normalized": False, "onesided": True, "n_mels": 80, "fmin": None,
                            "fmax": None, "htk": False, "frontend_conf": {}, "apply_stft": True}
#: Values of these keys that this module does not compute (ESPnet2's class runs instead)
UNCOVERED_VALUES = {"onesided": False, "apply_stft": False}
#: Options of ``frontend_conf`` (ESPnet's ``Frontend``) that, set, make ESPnet2's class run
UNCOVERED_INNER = ("use_wpe", "use_beamformer")
#: torch's window functions (``torch.<name>_window``), the names ESPnet2's ``Stft`` accepts
WINDOWS = ("hann", "hamming", "blackman", "bartlett", "kaiser")
#: ``LogMel``'s floor before the log
LOG_FLOOR = 1e-10

espnet_version()  # cached: read once where this is imported (a forkserver), not in each worker (~25 ms)


class Espnet2FrontendTooShortError(BadItemError):
    """A waveform too short for ESPnet2's STFT (reflect padding needs more than ``n_fft // 2``
    samples with ``center``, a frame ``n_fft`` without): ESPnet2's class fails on it too."""


@dataclass(frozen=True)
class DefaultFrontendSpec:
    """What decides ``DefaultFrontend``'s features (``win_length``, ``fmin`` and ``fmax`` resolved
    as ESPnet2 resolves them)."""

    fs: int = 16000
    n_fft: int = 512
    win_length: int = 512
    hop_length: int = 128
    window: str | None = "hann"
    center: bool = True
    normalized: bool = False
    n_mels: int = 80
    fmin: float = 0
    fmax: float = 8000.0
    htk: bool = False

    @property
    def min_samples(self) -> int:
        """The fewest samples ``torch.stft`` frames with this configuration."""
        if not self.center:
            return self.n_fft
        pad = self.n_fft // 2
        return max(pad + 1 if pad else 1, self.n_fft - 2 * pad)


def read_default_conf(conf: Mapping[str, Any]) -> tuple[DefaultFrontendSpec | None, list[str]]:
    """``frontend_conf`` of ESPnet2's ``default`` frontend as a spec, or ``None`` and the options
    this module does not compute (each as ``key=value``).

    Raises:
        ConfigError: a value ``DefaultFrontend`` would reject (its type or its range), named.
    """
    uncovered = [f"{k}={conf[k]!r}" for k in conf if k not in DEFAULTS]
    uncovered += [f"{k}={conf[k]!r}" for k, v in UNCOVERED_VALUES.items() if k in conf and conf[k] == v]
    inner = conf.get("frontend_conf", DEFAULTS["frontend_conf"])
    if inner is not None and not isinstance(inner, Mapping):
        raise ConfigError(f"frontend.conf.frontend_conf must be a mapping or null, got {inner!r}")
    uncovered += [f"frontend_conf.{k}={inner[k]!r}" for k in UNCOVERED_INNER if inner and inner.get(k)]
    args = {**DEFAULTS, **conf}
    for key in ("n_fft", "hop_length", "n_mels"):
        _check_type(key, args[key], int)
    for key in ("win_length", "fmin", "fmax"):
        _check_type(key, args[key], int, optional=True)
    for key in ("center", "normalized", "onesided", "htk", "apply_stft"):
        _check_type(key, args[key], bool)
    _check_type("window", args["window"], str, optional=True)
    if not isinstance(args["fs"], (int, str)) or isinstance(args["fs"], bool):
        raise ConfigError(f"frontend.conf.fs={args['fs']!r} must be an int or a string such as '16k' "
                          "(ESPnet2's DefaultFrontend: fs: Union[int, str])")
    n_fft, win = args["n_fft"], args["win_length"] if args["win_length"] is not None else args["n_fft"]
    if n_fft <= 0 or args["hop_length"] <= 0 or args["n_mels"] <= 0:
        raise ConfigError(f"frontend.conf: n_fft ({n_fft}), hop_length ({args['hop_length']}) and n_mels "
                          f"({args['n_mels']}) must be positive")
    if not 0 < win <= n_fft:
        raise ConfigError(f"frontend.conf.win_length={win} must be in (0, n_fft={n_fft}] (torch.stft's bounds)")
    if args["window"] is not None and args["window"] not in WINDOWS:
        raise ConfigError(f"frontend.conf.window={args['window']!r}: ESPnet2's Stft knows torch's windows "
                          f"{', '.join(WINDOWS)}, or null (rectangular)")
    if uncovered:
        return None, uncovered
    fs = parse_fs(args["fs"])
    return DefaultFrontendSpec(fs=fs, n_fft=n_fft, win_length=win, hop_length=args["hop_length"],
                               window=args["window"], center=args["center"], normalized=args["normalized"],
                               n_mels=args["n_mels"], fmin=0 if args["fmin"] is None else args["fmin"],
                               fmax=fs / 2 if args["fmax"] is None else args["fmax"], htk=args["htk"]), []


def warn_uncovered(conf: Mapping[str, Any]) -> None:
    """One warning naming the options of ``conf`` that make ESPnet2's class run instead of the fast
    path (nothing when it covers them all).

    Raises:
        ConfigError: a value ``DefaultFrontend`` would reject.
    """
    _, uncovered = read_default_conf(conf)
    if uncovered:
        warnings.warn(f"frontend.conf {', '.join(uncovered)}: not computed by the fast path of ESPnet2's default "
                      "frontend; ESPnet2's DefaultFrontend class runs instead (the same features, ~3x slower per "
                      "core; it rejects an option that is not its own either)", RuntimeWarning, stacklevel=3)


def _check_type(key: str, value: Any, kind: type, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        hint = f"Optional[{kind.__name__}]" if optional else kind.__name__
        raise ConfigError(f"frontend.conf.{key}={value!r} must be {'null or ' if optional else ''}"
                          f"{'an' if kind is int else 'a'} {kind.__name__} (ESPnet2's DefaultFrontend: {key}: {hint})")


# ---- librosa's mel matrix (librosa.filters.mel with norm="slaney", float32), in numpy -----------
_F_SP = 200.0 / 3  # Slaney's scale: linear below 1 kHz ...
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = np.log(6.4) / 27.0  # ... logarithmic above


def _hz_to_mel(hz: np.ndarray, htk: bool) -> np.ndarray:
    if htk:
        return 2595.0 * np.log10(1.0 + hz / 700.0)
    mels = hz / _F_SP
    if hz.ndim:
        high = hz >= _MIN_LOG_HZ
        mels[high] = _MIN_LOG_MEL + np.log(hz[high] / _MIN_LOG_HZ) / _LOGSTEP
    elif hz >= _MIN_LOG_HZ:
        mels = _MIN_LOG_MEL + np.log(hz / _MIN_LOG_HZ) / _LOGSTEP
    return mels


def _mel_to_hz(mels: np.ndarray, htk: bool) -> np.ndarray:
    if htk:
        return 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
    hz = _F_SP * mels
    high = mels >= _MIN_LOG_MEL
    hz[high] = _MIN_LOG_HZ * np.exp(_LOGSTEP * (mels[high] - _MIN_LOG_MEL))
    return hz


def mel_matrix(fs: float, n_fft: int, n_mels: int, fmin: float, fmax: float, htk: bool) -> np.ndarray:
    """``[n_mels, n_fft // 2 + 1]`` float32 triangular filters on the mel scale, each scaled to
    unit area (Slaney), as ``librosa.filters.mel(sr=fs, ..., norm="slaney")`` builds them: the
    triangles in float64, stored in float32, then scaled in float64 and stored again."""
    bins = np.fft.rfftfreq(n=n_fft, d=1.0 / fs)
    edges = np.linspace(_hz_to_mel(np.asanyarray(fmin), htk), _hz_to_mel(np.asanyarray(fmax), htk), n_mels + 2)
    centers = _mel_to_hz(edges, htk)
    widths = np.diff(centers)
    distance = np.subtract.outer(centers, bins)
    weights = np.zeros((n_mels, len(bins)), dtype=np.float32)
    for i in range(n_mels):
        rising = -distance[i] / widths[i]
        falling = distance[i + 2] / widths[i + 1]
        weights[i] = np.maximum(0, np.minimum(rising, falling))
    weights *= (2.0 / (centers[2:n_mels + 2] - centers[:n_mels]))[:, np.newaxis]
    if not np.all((centers[:-2] == 0) | (weights.max(axis=1) > 0)):
        warnings.warn(f"ESPnet2's DefaultFrontend mel matrix (fs={fs}, n_fft={n_fft}, n_mels={n_mels}) has empty "
                      "filters: some feature dimensions are always log(1e-10) (librosa warns the same)",
                      UserWarning, stacklevel=2)
    return weights


# ---- the features ---------------------------------------------------------------------------------
class FastDefaultFrontend:
    """ESPnet2's ``DefaultFrontend`` features of one mono waveform at a time, in eval mode.

    Args:
        spec: The configuration (:func:`read_default_conf`).
    """

    def __init__(self, spec: DefaultFrontendSpec):
        import torch

        self.spec = spec
        self.min_samples = spec.min_samples
        window = None
        if spec.window is not None:
            window = getattr(torch, f"{spec.window}_window")(spec.win_length, dtype=torch.float32)
        elif spec.win_length < spec.n_fft:
            window = torch.ones(spec.win_length, dtype=torch.float32)
        if window is not None and spec.win_length < spec.n_fft:  # centred in the frame, as torch.stft pads it
            left = (spec.n_fft - spec.win_length) // 2
            window = torch.nn.functional.pad(window, (left, spec.n_fft - spec.win_length - left))
        self._window = window
        self._norm = "ortho" if spec.normalized else "backward"  # normalized: n_fft ** -0.5, as torch.stft
        melmat = mel_matrix(spec.fs, spec.n_fft, spec.n_mels, spec.fmin, spec.fmax, spec.htk)
        self._bands = mel_bands(torch.from_numpy(melmat.T.copy()))

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        """``(frames, n_mels)`` float32 log-mel features of a mono float32 waveform.

        Raises:
            Espnet2FrontendTooShortError: fewer than ``min_samples`` samples.
        """
        import torch

        array = np.ascontiguousarray(samples, dtype=np.float32)
        if not array.flags.writeable:  # torch.from_numpy warns on read-only memory (nothing here writes to it)
            array = array.copy()
        if array.ndim != 1:
            raise ValueError(f"expected a mono waveform, got shape {array.shape}")
        if len(array) < self.min_samples:
            spec = self.spec
            why = (f"more than n_fft // 2 = {spec.n_fft // 2} (center=True)" if spec.center
                   else f"n_fft = {spec.n_fft} (center=False)")
            raise Espnet2FrontendTooShortError(f"audio of {len(array)} samples is too short for ESPnet2's "
                                               f"DefaultFrontend STFT: it needs {why}")
        with torch.inference_mode():
            return self._features(torch.from_numpy(array)).numpy()

    def _features(self, wave: Any) -> Any:
        import torch

        spec = self.spec
        if spec.center:
            pad = spec.n_fft // 2
            if pad:  # reflect, as torch.stft's default pad_mode (the edge sample is not repeated)
                wave = torch.cat((wave[1:pad + 1].flip(0), wave, wave[-pad - 1:-1].flip(0)))
        count = 1 + (wave.numel() - spec.n_fft) // spec.hop_length
        frames = wave.as_strided((count, spec.n_fft), (spec.hop_length, 1))
        if self._window is not None:
            frames = frames * self._window
        pairs = torch.view_as_real(torch.fft.rfft(frames, norm=self._norm)).square_()
        power = pairs[..., 0] + pairs[..., 1]
        mel = power.new_empty((spec.n_mels, count))
        for first, last, low, high, weights in self._bands:
            torch.matmul(weights, power[:, low:high].T, out=mel[first:last])
        return mel.clamp_min_(LOG_FLOOR).log_().T.contiguous()


def build_fast_default(conf: Mapping[str, Any]) -> FastDefaultFrontend | None:
    """The fast path for ``DefaultFrontend(**conf)``, or ``None`` where ESPnet2's class must run:
    an option it does not cover (:func:`warn_uncovered` said which), or an ESPnet release outside
    :data:`VERIFIED_ESPNET` whose class computes something else on the probe (warned here)."""
    from espnet3_flows.frontends import espnet2_frontend

    spec, _ = read_default_conf(conf)
    if spec is None:
        return None
    fast = FastDefaultFrontend(spec)
    version = espnet2_frontend.espnet_version()  # (looked up on its module: a test replaces it there)
    if version not in VERIFIED_ESPNET and not agrees_with_espnet2(fast, conf):
        warnings.warn(f"ESPnet {version}'s DefaultFrontend computes other features than the fast path (checked "
                      f"against ESPnet {', '.join(VERIFIED_ESPNET)}) on a probe signal: running ESPnet2's class",
                      RuntimeWarning, stacklevel=2)
        return None
    return fast


def agrees_with_espnet2(fast: FastDefaultFrontend, conf: Mapping[str, Any]) -> bool:
    """Whether ``fast`` computes what ESPnet2's installed ``DefaultFrontend(**conf)`` does, on
    0.37 s of noise and a tone (for ESPnet releases not in :data:`VERIFIED_ESPNET`)."""
    import torch

    from espnet3_flows.frontends.espnet2_frontend import build_espnet2_frontend

    reference = build_espnet2_frontend("default", conf)
    n = max(fast.min_samples, int(0.37 * fast.spec.fs))
    rng = np.random.default_rng(0)
    probes = [0.1 * rng.standard_normal(n), 0.5 * np.sin(2 * np.pi * 440 * np.arange(n) / fast.spec.fs)]
    for probe in (p.astype(np.float32) for p in probes):
        try:
            mine = fast(probe)
        except Exception:  # noqa: BLE001 - any failure means: do not use the fast path
            return False
        with torch.inference_mode():
            ref = reference(torch.from_numpy(probe)[None], torch.tensor([n]))[0][0].numpy()
        if mine.shape != ref.shape or not np.allclose(mine, ref, rtol=1e-4, atol=1e-4):
            return False
    return True
