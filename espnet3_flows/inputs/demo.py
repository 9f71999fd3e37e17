"""Demo corpus: synthetic speech-like utterances from several speakers, generated locally (no download)."""

from __future__ import annotations

import contextlib
import contextvars
from pathlib import Path
from collections.abc import Iterator

import numpy as np
import soundfile as sf

from espnet3_flows.config import ConfigError
from espnet3_flows.inputs.settings import DEMO_UTTERANCES
from espnet3_flows.storage import Storage, replace_atomically


def synth_utterance(rng: np.random.Generator, seconds: float, sr: int, f0: float, formants: tuple[float, ...]) -> np.ndarray:
    """One speech-like waveform: a glottal-pulse-like harmonic source with a wandering pitch,
    shaped by speaker formants and chopped into syllables (~4 Hz), plus a little noise."""
    n = max(1, int(seconds * sr))
    t = np.arange(n) / sr
    pitch = f0 * (1.0 + 0.08 * np.sin(2 * np.pi * rng.uniform(0.2, 0.7) * t + rng.uniform(0, 6.28)))
    phase = 2 * np.pi * np.cumsum(pitch) / sr
    signal = np.zeros(n)
    for h in range(1, min(24, int(0.45 * sr / f0))):
        freq = h * f0  # formant gain from the mean pitch: cheap and close enough for a demo
        gain = sum(np.exp(-0.5 * ((freq - f) / (0.12 * f)) ** 2) for f in formants) + 0.05
        signal += (gain / h) * np.sin(h * phase)
    syll_rate = rng.uniform(3.0, 5.0)
    envelope = np.clip(np.sin(2 * np.pi * syll_rate * t + rng.uniform(0, 6.28)), 0, None) ** 0.7
    signal = signal * envelope + 0.01 * rng.standard_normal(n)
    signal /= max(1e-6, np.abs(signal).max())
    return (0.5 * signal).astype(np.float32)


#: The demo corpus's splits and their shares
DEMO_SPLITS = {"train": 0.8, "valid": 0.1, "test": 0.1}
_GENERATE = contextvars.ContextVar("espnet3_flows_demo_generate", default=True)


@contextlib.contextmanager
def demo_not_generated() -> Iterator[None]:
    """Within it the demo's settings name where its corpus and model would be, and nothing is
    written (``--dry-run`` writes nothing, anywhere)."""
    token = _GENERATE.set(False)
    try:
        yield
    finally:
        _GENERATE.reset(token)


def demo_generated() -> bool:
    """Whether the demo's data is generated now (outside :func:`demo_not_generated`)."""
    return _GENERATE.get()


def pending_demo(output_dir: str, manifests: dict[str, str]) -> Path | None:
    """The demo corpus's directory when ``manifests`` are the demo's and it is not generated yet."""
    try:
        root = demo_root(output_dir)
    except ConfigError:
        return None
    ours = [Path(m) for m in manifests.values() if Path(m).parent == root]
    return root if ours and not all(m.is_file() for m in ours) else None


def make_demo_corpus(out_dir: str | Path, n_utts: int = DEMO_UTTERANCES, n_speakers: int = 6, sampling_rate: int = 16000,
                     min_seconds: float = 1.0, max_seconds: float = 4.0, seed: int = 0,
                     splits: dict[str, float] | None = None) -> dict[str, Path]:
    """Write WAV files and one TSV manifest per split (``utt_id<TAB>wav_path<TAB>text<TAB>speaker_id``).

    Existing files with the same names are reused, so a second call is cheap and leaves
    file fingerprints (and therefore shard hashes) unchanged.

    Args:
        out_dir: Where ``wav/`` and ``<split>.tsv`` are written.
        n_utts: Total utterances over all splits.
        n_speakers: Number of synthetic speakers (each has its own pitch and formants).
        sampling_rate: Sampling rate of the files.
        min_seconds: Shortest utterance.
        max_seconds: Longest utterance.
        seed: Random seed (the corpus is a pure function of the arguments).
        splits: Split name → fraction (default ``train`` 0.8, ``valid`` 0.1, ``test`` 0.1).

    Returns:
        Split name → manifest path.
    """
    out = Path(out_dir)
    (out / "wav").mkdir(parents=True, exist_ok=True)
    fractions = splits or DEMO_SPLITS
    rng = np.random.default_rng(seed)
    speakers = [(f"spk{k:02d}", float(rng.uniform(90, 240)),
                 (float(rng.uniform(500, 900)), float(rng.uniform(1100, 1900)), float(rng.uniform(2300, 3000))))
                for k in range(n_speakers)]
    names = list(fractions)
    counts = [int(round(fractions[s] * n_utts)) for s in names]
    counts[0] += n_utts - sum(counts)
    manifests: dict[str, Path] = {}
    k = 0
    for split, count in zip(names, counts, strict=True):
        lines = []
        for _ in range(count):
            spk, f0, formants = speakers[k % n_speakers]
            utt_id = f"{spk}-utt{k:05d}"
            seconds = float(rng.uniform(min_seconds, max_seconds))
            utt_rng = np.random.default_rng([seed, k])
            wav = out / "wav" / f"{utt_id}.wav"
            if not wav.exists():
                audio = synth_utterance(utt_rng, seconds, sampling_rate, f0, formants)
                replace_atomically(wav, lambda f, a=audio: sf.write(f, a, sampling_rate, format="WAV",
                                                                     subtype="PCM_16"), fsync=False)
            lines.append(f"{utt_id}\t{wav.resolve()}\tdemo utterance {k}\t{spk}")
            k += 1
        manifest = out / f"{split}.tsv"
        text = "\n".join(lines) + "\n"
        if not manifest.exists() or manifest.read_text() != text:
            manifest.write_text(text)
        manifests[split] = manifest
    return manifests


def demo_root(output_dir: str) -> Path:
    """Where demo data goes: beside a local ``output_dir`` (``<parent>/demo_data``)."""
    store = Storage(output_dir)
    if not store.is_local:
        raise ConfigError("no input given: the demo corpus needs a local output location; name your manifests")
    return Path(store.path()).parent / "demo_data"


def demo_manifests(output_dir: str, n_utts: int) -> dict[str, str]:
    """Generate the demo corpus beside a local ``output_dir`` and return its manifests (only
    their paths within :func:`demo_not_generated`)."""
    root = demo_root(output_dir)
    if not demo_generated():
        return {split: str(root / f"{split}.tsv") for split in DEMO_SPLITS}
    return {k: str(v) for k, v in make_demo_corpus(root, n_utts=n_utts).items()}
