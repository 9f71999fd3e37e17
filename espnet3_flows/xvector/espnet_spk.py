"""ESPnet-SPK speaker embeddings (``xvector.toolkit: espnet``), as ``espnet2.bin.spk_inference.Speech2Embedding``.

A model is named as ESPnet's recipes name it (``extract_spk_embed.py --toolkit espnet``): a
``.pth`` with the ``config.yaml`` of its training beside it, a directory holding them (or an
unpacked model with ``meta.yaml``), or a model tag (``espnet/voxcelebs12_rawnet3``) already in
the local Hugging Face cache. Nothing is downloaded. The model is built by ESPnet's own
``SpeakerTask.build_model`` from that config and its weights loaded as ESPnet loads them (but
with ``weights_only=True``), so :func:`espnet_embedder` returns what ``Speech2Embedding`` returns
for each utterance alone, also for padded batches (see :mod:`espnet3_flows.xvector.spk_exact`).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from espnet3_flows.xvector.model import XVectorModelError, looks_like_path, validate_device

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
META_FILE = "meta.yaml"  # an ESPnet model-zoo package (as on the Hugging Face Hub)
#: Top-level modules that ``espnet2.tasks.spk`` imports beyond the collect-stats ones (the
#: ``espnet`` extra installs them): checked on the driver without importing ESPnet (seconds).
SPK_TASK_MODULES = ("espnet2", "asteroid_filterbanks", "h5py", "g2p_en", "jamo", "tacotron_cleaner")


def install_hint() -> str:
    """How to install what ESPnet's speaker task needs (the ``espnet`` extra)."""
    from espnet3_flows.frontends.espnet2_frontend import INSTALL_HINT

    return INSTALL_HINT


def missing_spk_modules() -> list[str]:
    """The modules of `SPK_TASK_MODULES` that are not installed."""
    return [m for m in SPK_TASK_MODULES if importlib.util.find_spec(m) is None]


def import_speaker_task() -> Any:
    """``espnet2.tasks.spk.SpeakerTask``, imported without the network.

    Importing it imports ``g2p_en`` (through ESPnet's text preprocessor), which downloads NLTK
    data when it is missing; speaker embeddings never use it, so that download is refused here.
    Raises XVectorModelError naming the missing package and the extra.
    """
    try:
        import nltk
    except ImportError:
        nltk = None
    refused = getattr(nltk, "download", None)
    try:
        if nltk is not None:
            nltk.download = lambda *args, **kwargs: False  # see the docstring
        from espnet2.tasks.spk import SpeakerTask
    except ImportError as exc:
        raise XVectorModelError(f"ESPnet's speaker task cannot be imported ({exc}): {install_hint()}") from None
    finally:
        if nltk is not None:
            nltk.download = refused
    return SpeakerTask


@dataclass(frozen=True)
class EspnetSpkFiles:
    """The two files of an ESPnet-SPK model: its training ``config.yaml`` and its ``.pth`` weights."""

    config: Path
    weights: Path
    root: Path  # where relative paths in the config are resolved (the package's root)


def _from_meta(root: Path, source: str) -> EspnetSpkFiles:
    """The files a model package's ``meta.yaml`` names (as ESPnet's model zoo reads it)."""
    import yaml

    try:
        meta = yaml.safe_load((root / META_FILE).read_text(encoding="utf-8"))
        yaml_files, files = dict(meta["yaml_files"]), dict(meta["files"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as exc:
        raise XVectorModelError(f"{source!r}: {root / META_FILE} is not an ESPnet model package's meta.yaml "
                                f"({type(exc).__name__}: {exc})") from None
    config = yaml_files.get("train_config") or next(iter(yaml_files.values()), None)
    weights = files.get("model_file") or next((v for v in files.values() if str(v).endswith(".pth")), None)
    if not config or not weights:
        raise XVectorModelError(f"{source!r}: {root / META_FILE} names no train_config / model_file")
    return _checked(root / str(config), root / str(weights), root, source)


def _checked(config: Path, weights: Path, root: Path, source: str) -> EspnetSpkFiles:
    missing = [f"its {what} {str(path)!r}" for path, what in ((weights, "weights"), (config, "config.yaml"))
               if not path.is_file()]
    if missing:
        raise XVectorModelError(f"ESPnet-SPK model {source!r}: {' and '.join(missing)} "
                                f"{'does' if len(missing) == 1 else 'do'} not exist (not downloaded, or copied "
                                "in part? this job never downloads models)")
    return EspnetSpkFiles(config.resolve(), weights.resolve(), root.resolve())


def resolve_espnet_model(source: str) -> EspnetSpkFiles:
    """The config and weights of an ESPnet-SPK model, without the network.

    ``source`` is a ``.pth`` (its ``config.yaml`` beside it, ESPnet's rule when no config is
    given), a directory with ``meta.yaml`` (an unpacked model package) or with ``config.yaml``
    and one ``.pth``, or a Hugging Face model tag whose package is already in the local cache.

    Raises:
        XVectorModelError: naming the source and what is missing.
    """
    local = Path(source).expanduser()
    if local.is_file():
        if local.suffix != ".pth":
            raise XVectorModelError(f"ESPnet-SPK model {source!r} is a file but not a .pth")
        return _checked(local.parent / CONFIG_FILE, local, local.parent, source)
    if local.is_dir():
        if (local / META_FILE).is_file():
            return _from_meta(local, source)
        weights = sorted(local.glob("*.pth"))
        if len(weights) != 1:
            found = ", ".join(p.name for p in weights) or "none"
            raise XVectorModelError(f"ESPnet-SPK model directory {source!r} must hold one .pth beside its "
                                    f"config.yaml (found: {found}); name the .pth itself")
        return _checked(local / CONFIG_FILE, weights[0], local, source)
    if looks_like_path(source) or source.count("/") != 1:
        raise XVectorModelError(f"ESPnet-SPK model {source!r} does not exist (a .pth, a model directory, or a "
                                "model tag such as espnet/voxcelebs12_rawnet3 in the local Hugging Face cache)")
    from huggingface_hub import try_to_load_from_cache

    tag, _, revision = source.partition("@")
    try:
        cached = try_to_load_from_cache(tag, META_FILE, revision=revision or None)
    except ValueError as exc:
        raise XVectorModelError(f"{source!r} is neither a local ESPnet-SPK model nor a valid model tag ({exc})") from None
    if not isinstance(cached, str):
        raise XVectorModelError(
            f"{source!r} is neither a local ESPnet-SPK model nor a model tag in the local Hugging Face cache, "
            "and this job never downloads models: fetch it where the network is reachable "
            f"(`hf download {tag}`, or `hf download {tag} --local-dir DIR` and pass DIR)")
    return _from_meta(Path(cached).parent, source)


def _train_args(files: EspnetSpkFiles) -> argparse.Namespace:
    """The training config as ESPnet's ``build_model_from_file`` reads it (a relative stats file is
    taken from the model package, where the model zoo would have rewritten it)."""
    import yaml

    args = yaml.safe_load(files.config.read_text(encoding="utf-8"))
    if not isinstance(args, dict):
        raise XVectorModelError(f"{files.config} is not an ESPnet training config (a YAML mapping)")
    stats = (args.get("normalize_conf") or {}).get("stats_file")
    if stats and not Path(stats).is_absolute() and (files.root / stats).is_file():
        args["normalize_conf"] = {**args["normalize_conf"], "stats_file": str(files.root / stats)}
    return argparse.Namespace(**args)


def load_espnet_spk_model(source: str, device: str = "cpu") -> torch.nn.Module:
    """ESPnet's ``ESPnetSpeakerModel`` for ``source`` (see `resolve_espnet_model`), in eval mode on
    ``device``: ``SpeakerTask.build_model`` on its config, its weights loaded with
    ``weights_only=True``. ESPnet loads non-strictly; a weight the model needs that the file lacks
    (other than the training loss's) is an error here rather than a silently random layer."""
    device = validate_device(device)
    files = resolve_espnet_model(source)
    task = import_speaker_task()
    args = _train_args(files)
    try:
        model = task.build_model(args)
        model.to(device)
        if getattr(args, "use_adapter", False):
            from espnet2.layers.create_adapter import create_adapter

            create_adapter(model, args.adapter, args.adapter_conf)
        state = torch.load(files.weights, map_location=device, weights_only=True)
    except Exception as exc:
        raise XVectorModelError(f"could not build the ESPnet-SPK model {source!r} from {files.config} and "
                                f"{files.weights}: {type(exc).__name__}: {exc}") from exc
    state = state.get("module", state) if isinstance(state, dict) else state
    missing, _ = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("loss.")]
    if missing:
        raise XVectorModelError(f"{files.weights} lacks {len(missing)} weights of the model its config.yaml "
                                f"describes (e.g. {missing[:3]}): not this model's weights?")
    return model.eval()


def espnet_embedder(model: torch.nn.Module, exact_padding: bool | None = None) -> Any:
    """An `~espnet3_flows.xvector.model.EmbeddingModel` for an ESPnet-SPK model.

    A batch of one utterance (or of utterances of one length) goes through the model exactly as
    ``Speech2Embedding`` sends it. Padded batches are aligned (`spk_exact`) when the architecture
    allows it (``exact_padding=None``: whenever possible; ``True``: ValueError otherwise), else
    split into groups of equal length, so each utterance always gets its own embedding.
    """
    from espnet3_flows.xvector.spk_exact import SpkPaddingAligner, _Ambiguous, alignment_problem

    problem = alignment_problem(model) if exact_padding is not False else "exact padding was switched off"
    if problem is not None and exact_padding:
        raise ValueError(f"exact padding was requested but is not possible: {problem}")
    aligner = SpkPaddingAligner(model) if problem is None else None
    if problem is not None and exact_padding is None:
        logger.warning("ESPnet-SPK batches are grouped by equal length (padding would change embeddings): %s",
                       problem)
    device = next(model.parameters()).device

    def alone(wavs: torch.Tensor) -> torch.Tensor:
        return model(speech=wavs.to(device, torch.float32), extract_embd=True)

    def embed(wavs: torch.Tensor, wav_lens: torch.Tensor) -> torch.Tensor:
        n = wavs.shape[1]
        samples = torch.round(wav_lens.double().cpu() * n).long().clamp(1, n)
        with torch.inference_mode():
            if bool((samples == n).all()):
                return alone(wavs)
            if aligner is not None:
                try:
                    return aligner.embed([w[:k].to(device, torch.float32) for w, k in zip(wavs, samples.tolist(), strict=True)])
                except _Ambiguous:
                    pass
            out: list[torch.Tensor | None] = [None] * len(samples)
            for length in samples.unique().tolist():
                rows = (samples == length).nonzero().flatten()
                for row, emb in zip(rows.tolist(), alone(wavs[rows, :length]), strict=True):
                    out[row] = emb
            return torch.stack(out)  # type: ignore[arg-type]

    embed.model = model  # type: ignore[attr-defined]
    return embed
