"""Speaker-embedding models for x-vector extraction: offline speechbrain loading and length-sorted batching.

Any callable ``(wavs [B, T] float32, wav_lens [B] relative lengths) -> [B, D]`` is an
`EmbeddingModel`; `speechbrain_embedder` makes one from a speechbrain ``EncoderClassifier``, and a
second toolkit plugs in by providing such a callable. `embed_waveforms` runs a model over
utterances in length-sorted, zero-padded batches and returns the embeddings in input order.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from collections.abc import Sequence

import numpy as np
import torch

from espnet3_flows.config import check_device
from espnet3_flows.errors import BadItemError, Espnet3FlowsError

if TYPE_CHECKING:
    from speechbrain.inference.speaker import EncoderClassifier

HPARAMS_FILE = "hyperparams.yaml"
# Downloaded speechbrain model directories (e.g. spkrec-ecapa-voxceleb) point their pretrainer at
# `<pretrained_path>/...` with pretrained_path set to the hub id: loading one "offline" would still
# go to the hub unless pretrained_path is pointed at the directory itself.
_PRETRAINED_PATH_RE = re.compile(r"^pretrained_path\s*:", re.MULTILINE)


class XVectorModelError(Espnet3FlowsError, RuntimeError):
    """An embedding model cannot be loaded or used (missing files, unreachable hub id, no CUDA...)."""


@runtime_checkable
class EmbeddingModel(Protocol):
    """Maps a zero-padded batch of waveforms to one embedding per utterance.

    ``wavs``: float32 [B, T] at the model's sample rate, zero-padded on the right.
    ``wav_lens``: float32 [B], each utterance's length divided by T, in (0, 1].
    Returns a float tensor [B, D] (any device).
    """

    def __call__(self, wavs: torch.Tensor, wav_lens: torch.Tensor) -> torch.Tensor: ...


def validate_device(device: str) -> str:
    """Return ``device`` if it is ``cpu``, ``cuda`` or ``cuda:N`` and usable here.

    Raises ValueError (a :class:`~espnet3_flows.config.ConfigError`) for a malformed name (see
    :func:`~espnet3_flows.config.check_device`), XVectorModelError when CUDA (or GPU N) is not available.
    """
    check_device(device)
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise XVectorModelError(f"device {device!r} requested but torch.cuda is not available")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise XVectorModelError(
                f"device {device!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
    return device


def looks_like_path(source: str) -> bool:
    """True for sources that can only be filesystem paths, never hub ids."""
    return source.startswith(("/", "./", "../", "~", ".\\", "..\\")) or source in (".", "..") or "\\" in source


def resolve_model_source(source: str | Path) -> Path:
    """The local directory holding ``hyperparams.yaml`` for a model source, without the network.

    ``source`` is a local model directory, or a Hugging Face hub id (``org/name``) whose files
    are already in the local hub cache (``HF_HUB_CACHE``, ``HF_HOME``): the cached snapshot
    directory is returned. Nothing is ever downloaded.

    Raises:
        XVectorModelError: naming the source and what to do, when neither is the case.
    """
    source_str = str(source)
    local = Path(source_str).expanduser()
    if isinstance(source, Path) or local.exists() or looks_like_path(source_str) or source_str.count("/") != 1:
        if not local.is_dir():
            raise XVectorModelError(f"speechbrain model directory {source_str!r} does not exist")
        if not (local / HPARAMS_FILE).is_file():
            raise XVectorModelError(
                f"speechbrain model directory {str(local)!r} has no {HPARAMS_FILE}; "
                "pass the directory that holds hyperparams.yaml and the .ckpt files")
        return _complete(local.resolve(), source_str)
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(source_str, HPARAMS_FILE)
    except ValueError as exc:  # huggingface_hub's HFValidationError: not a repo id at all
        raise XVectorModelError(f"{source_str!r} is neither a local model directory nor a valid hub id "
                                f"({exc})") from None
    if not isinstance(cached, str):
        raise XVectorModelError(
            f"{source_str!r} is neither a local model directory nor a hub id in the local Hugging Face "
            "cache, and this job never downloads models: fetch it where the network is reachable "
            f"(`hf download {source_str} --local-dir DIR`) and pass DIR")
    return _complete(Path(cached).parent, source_str)


#: Classes whose checkpoint loader is speechbrain's ``load_if_possible``: a loadable of one
#: (the label encoder) may be missing from a directory, and the model still loads
_LOADED_IF_POSSIBLE = "speechbrain.dataio.encoder."


def speechbrain_model_files(hparams: str) -> list[str]:
    """The files of a speechbrain model directory that its ``hyperparams.yaml`` (the text
    ``hparams``) cannot load without: ``hyperparams.yaml``, then the pretrainer's ``paths``
    under ``<pretrained_path>/`` (``<name>.ckpt`` for a loadable with no path: speechbrain's
    default), less those of objects speechbrain loads only if possible (a label encoder). Paths
    elsewhere (another directory, a hub id) are not listed."""
    import yaml

    class _Plain(yaml.SafeLoader):
        """Reads speechbrain's tags as the plain values they tag; ``!new:CLASS`` as ``{"__new__": CLASS, ...}``."""

    def plain(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
        if isinstance(node, yaml.MappingNode):
            value: Any = loader.construct_mapping(node, deep=True)
        elif isinstance(node, yaml.SequenceNode):
            return loader.construct_sequence(node, deep=True)
        else:
            value = loader.construct_scalar(node)  # type: ignore[arg-type]
        return {**(value or {}), "__new__": suffix[4:]} if suffix.startswith("new:") else value

    _Plain.add_multi_constructor("!", plain)
    tree = yaml.load(hparams, Loader=_Plain)  # (a SafeLoader: tags only give plain values)
    tree = tree if isinstance(tree, dict) else {}
    files = [HPARAMS_FILE]
    for value in tree.values():
        if not (isinstance(value, dict) and isinstance(value.get("loadables"), dict)):
            continue
        paths = value.get("paths") if isinstance(value.get("paths"), dict) else {}
        for name, obj in value["loadables"].items():
            target = tree.get(str(obj).strip("<>"), {}) if isinstance(obj, str) else obj
            if isinstance(target, dict) and str(target.get("__new__", "")).startswith(_LOADED_IF_POSSIBLE):
                continue
            path = str(paths.get(name, f"<pretrained_path>/{name}.ckpt"))
            if path.startswith("<pretrained_path>/"):
                files.append(path.removeprefix("<pretrained_path>/"))
    return list(dict.fromkeys(files))


def _complete(local: Path, source: str) -> Path:
    """``local``, once every file its ``hyperparams.yaml`` loads is there; else an error listing
    the missing ones (a directory copied in part from another machine)."""
    try:
        needed = speechbrain_model_files((local / HPARAMS_FILE).read_text(encoding="utf-8"))
    except Exception:  # noqa: BLE001 - an unreadable hyperparams.yaml: speechbrain's loader names its fault
        return local
    missing = [name for name in needed if not (local / name).is_file()]
    if missing:
        raise XVectorModelError(
            f"speechbrain model {source!r} ({local}) lacks {len(missing)} file(s) its {HPARAMS_FILE} loads: "
            f"{', '.join(missing)}; copy the whole model directory (every file listed in "
            "docs/configuration.md, \"A model from another machine\")")
    return local


def load_speechbrain_encoder(
    source: str | Path, savedir: str | Path, device: str = "cpu"
) -> EncoderClassifier:
    """Load a speechbrain ``EncoderClassifier`` (e.g. ECAPA-TDNN) for inference on ``device``.

    ``source`` is what :func:`resolve_model_source` takes: a local model directory or a hub id
    already in the local cache; either is loaded as a directory with the network disallowed (a
    top-level ``pretrained_path`` in ``hyperparams.yaml`` is pointed at the directory).
    ``savedir`` receives speechbrain's links to the model files. Raises XVectorModelError
    naming the source when it cannot be loaded.
    """
    from speechbrain.inference.speaker import EncoderClassifier
    from speechbrain.utils.fetching import FetchConfig

    device = validate_device(device)
    local = resolve_model_source(source)
    overrides = {}
    if _PRETRAINED_PATH_RE.search((local / HPARAMS_FILE).read_text(encoding="utf-8")):
        overrides["pretrained_path"] = str(local)
    try:
        # overwrite=True re-links every file: a savedir reused from another model would
        # otherwise silently serve that model's hyperparams.yaml and checkpoints.
        return EncoderClassifier.from_hparams(
            source=str(local),
            savedir=str(Path(savedir)),
            run_opts={"device": device},
            overrides=overrides,
            fetch_config=FetchConfig(overwrite=True, allow_network=False),
        )
    except Exception as exc:
        raise XVectorModelError(
            f"could not load the speechbrain model in {str(local)!r} (from {str(source)!r}): "
            f"{type(exc).__name__}: {exc}") from exc


def speechbrain_embedder(encoder: Any, exact_padding: bool | None = None) -> EmbeddingModel:
    """Wrap a speechbrain ``EncoderClassifier`` as an EmbeddingModel returning [B, D].

    With ``exact_padding`` (default: whenever the architecture allows it, as for ECAPA-TDNN and
    TDNN x-vectors), an utterance gets the same embedding in a padded batch as alone; see
    `espnet3_flows.xvector.exact_padding`. ``False`` calls ``encode_batch`` as is; ``True``
    raises ValueError when the architecture does not allow it.
    """
    from espnet3_flows.xvector.exact_padding import make_aligner

    aligner = make_aligner(encoder, exact_padding)
    encode = aligner.encode if aligner is not None else encoder.encode_batch

    def embed(wavs: torch.Tensor, wav_lens: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out = encode(wavs, wav_lens)
        if out.dim() != 3 or out.shape[1] != 1:
            raise XVectorModelError(f"encode_batch returned shape {tuple(out.shape)}, expected [B, 1, D]")
        return out.squeeze(1)

    embed.encoder = encoder  # type: ignore[attr-defined]  # the aligner holds it only weakly
    return embed


def length_sorted_batches(
    lengths: Sequence[int], max_batch_size: int, max_padded_samples: int | None = None
) -> list[list[int]]:
    """Group indices of ``lengths`` into batches of similar length, longest first.

    Each batch has at most ``max_batch_size`` items and, when ``max_padded_samples`` is given, at
    most that many samples once padded (items x longest); an item longer than the limit alone
    forms its own batch. Every index appears exactly once; ties keep input order.
    """
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
    if max_padded_samples is not None and (
        isinstance(max_padded_samples, bool) or not isinstance(max_padded_samples, int) or max_padded_samples < 1
    ):
        raise ValueError(f"max_padded_samples must be a positive int or None, got {max_padded_samples!r}")
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"lengths[{i}] must be a non-negative int, got {n!r}")

    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current:
            longest = int(lengths[current[0]])  # descending order: the first is the longest
            full = len(current) >= max_batch_size
            too_big = max_padded_samples is not None and (len(current) + 1) * longest > max_padded_samples
            if full or too_big:
                batches.append(current)
                current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def _as_waveform(wave: Any, index: int, ids: Sequence[str] | None) -> np.ndarray:
    """``wave`` as a 1-D float32 array; BadItemError naming the item when it is not a usable one."""
    name = f"utterance {ids[index]!r}" if ids is not None else f"waveform {index}"
    arr = np.asarray(wave)
    if arr.ndim != 1:
        raise BadItemError(f"{name}: expected a 1-D waveform, got shape {arr.shape}")
    if arr.size == 0:
        raise BadItemError(f"{name}: empty waveform")
    if not np.issubdtype(arr.dtype, np.floating):
        raise BadItemError(f"{name}: expected float samples in [-1, 1], got dtype {arr.dtype}")
    if not np.isfinite(arr).all():
        raise BadItemError(f"{name}: waveform contains NaN or infinite samples")
    return arr.astype(np.float32, copy=False)


def embed_waveforms(
    model: EmbeddingModel,
    waves: Sequence[np.ndarray],
    batch_size: int,
    max_padded_samples: int | None = None,
    ids: Sequence[str] | None = None,
    device: str | None = None,
) -> np.ndarray:
    """Embed ``waves`` (1-D float arrays) with ``model``; returns float32 [N, D] in input order.

    Utterances are grouped by `length_sorted_batches`, zero-padded, and passed with relative
    lengths ``len / max_len``. ``ids`` (optional, one per wave) name items in error messages.
    ``device`` (default: the model's ``device`` attribute, as `~espnet3_flows.xvector.job.with_precision`
    sets it; else the host): on a CUDA GPU each batch is assembled in pinned memory and copied to the
    GPU while the model works on the previous one (`~espnet3_flows.frontends.pinned.overlapped`),
    unless the model says it takes its batches on the host (a true ``host_input`` attribute).
    An empty ``waves`` gives an array of shape [0, 0].
    """
    from espnet3_flows.frontends.pinned import PinnedStaging, overlapped

    if ids is not None and len(ids) != len(waves):
        raise ValueError(f"got {len(ids)} ids for {len(waves)} waveforms")
    arrays = [_as_waveform(w, i, ids) for i, w in enumerate(waves)]
    if not arrays:
        return np.zeros((0, 0), dtype=np.float32)
    device = None if getattr(model, "host_input", False) else device or getattr(model, "device", None)
    staging = PinnedStaging() if device is not None and str(device).startswith("cuda") else None

    def stage(batch: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        longest = arrays[batch[0]].shape[0]
        wavs = (staging.take(len(batch) * longest).view(len(batch), longest) if staging is not None
                else torch.empty(len(batch), longest, dtype=torch.float32))
        for row, i in enumerate(batch):
            wavs[row, : arrays[i].shape[0]] = torch.from_numpy(arrays[i])
            wavs[row, arrays[i].shape[0]:] = 0.0
        wav_lens = torch.tensor([arrays[i].shape[0] / longest for i in batch], dtype=torch.float32)
        return (wavs if staging is None else staging.to_device(wavs, device)), wav_lens

    def launch(batch: list[int], staged: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = model(*staged)
        if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != len(batch):
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise XVectorModelError(f"embedding model returned {shape} for a batch of {len(batch)}, expected [B, D]")
        return out

    batches = length_sorted_batches([a.shape[0] for a in arrays], batch_size, max_padded_samples)
    result: np.ndarray | None = None
    for batch, out in zip(batches, overlapped(batches, stage, launch), strict=True):
        emb = out.detach().to("cpu", torch.float32).numpy()
        if result is None:
            result = np.empty((len(arrays), emb.shape[1]), dtype=np.float32)
        elif emb.shape[1] != result.shape[1]:
            raise XVectorModelError(f"embedding dimension changed from {result.shape[1]} to {emb.shape[1]}")
        result[batch] = emb
    assert result is not None
    return result
