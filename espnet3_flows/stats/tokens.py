"""Token counts of transcripts for ESPnet2's ``text_shape`` (the ``tokens:`` section of collect-stats).

ESPnet2's stage 10 writes ``text_shape`` (tokens per utterance, after the recipe's cleaner,
tokenizer and token list) and ``asr.sh`` derives ``text_shape.<token_type>`` (``N,vocabulary``),
which later stages pass as ``--train_shape_file``. The counts here come from ESPnet2's own
tokenizer classes and ``TokenIDConverter``, as ESPnet2's ``CommonPreprocessor`` applies them
(espnet extra). Settings are ESPnet2's ``asr.yaml`` keys, or read from a trained model's
``config.yaml`` (``frontend.espnet_config``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping

from espnet3_flows.config import ConfigError, check_choices

TOKEN_TYPES = ("", "none", "char", "word", "bpe", "phn")
_CONFIG_KEYS = ("token_type", "token_list", "bpemodel", "non_linguistic_symbols", "cleaner", "g2p")


@dataclass
class TokenConfig:
    """The ``tokens:`` section: how transcripts are counted for ``text_shape``.

    Attributes:
        token_type: ``char``, ``word``, ``bpe`` or ``phn`` as in ESPnet2; ``none``: no
            ``text_shape``; empty (default): ``frontend.espnet_config``'s, if it names one, else
            none. With one, collect-stats writes ``text_shape`` and ``text_shape.<token_type>``
            as ``asr.sh`` stage 10 does (``docs/configuration.md``, "Replacing ``asr.sh`` stage 10").
        token_list: The token list: a file (one token a line, ESPnet2's ``tokens.txt``) or the
            list itself (a trained model's ``config.yaml`` holds it inline). Unknown tokens
            count as ``<unk>``, as in ESPnet2.
        bpemodel: For ``bpe``: the sentencepiece model file.
        non_linguistic_symbols: ESPnet2's ``non_linguistic_symbols`` file (kept as single tokens).
        cleaner: ESPnet2's text cleaner (``tacotron``, ``jaconv``, ``whisper_en``, ...); empty: none.
        g2p: For ``phn``: ESPnet2's ``g2p`` (``g2p_en``, ``pyopenjtalk``, ...).
    """

    # named like credentials, but a tokenizer's settings (espnet3_flows.credentials)
    token_type: str = field(default="", metadata={"choices": TOKEN_TYPES, "secret": False})
    token_list: Any = field(default="", metadata={"secret": False})
    bpemodel: str = ""
    non_linguistic_symbols: str = ""
    cleaner: str = ""
    g2p: str = ""

    def __post_init__(self) -> None:
        check_choices(self, "tokens.")
        if self.enabled and not self.token_list:
            raise ConfigError(f"tokens.token_type={self.token_type} needs tokens.token_list (ESPnet2's tokens.txt)")
        if self.token_type == "bpe" and not self.bpemodel:
            raise ConfigError("tokens.token_type=bpe needs tokens.bpemodel (the sentencepiece model)")

    @property
    def enabled(self) -> bool:
        """Whether transcripts are counted (``text_shape`` is written)."""
        return self.token_type not in ("", "none")

    def fill_from_espnet_config(self, config: Mapping[str, Any]) -> None:
        """Take the token settings of a trained model's ``config.yaml`` when none are set here."""
        if self.token_type or not config.get("token_type"):
            return
        for key in _CONFIG_KEYS:
            if config.get(key) not in (None, ""):
                setattr(self, key, config[key] if key == "token_list" else str(config[key]))
        self.__post_init__()

    def hashed(self) -> dict[str, Any]:
        """What decides the counts: the settings, with the token list and model files' contents."""
        if not self.enabled:
            return {}
        return {"token_type": self.token_type, "token_list": _digest(self.token_list),
                "bpemodel": _digest(self.bpemodel) if self.bpemodel else "",
                "non_linguistic_symbols": _digest(self.non_linguistic_symbols) if self.non_linguistic_symbols else "",
                "cleaner": self.cleaner, "g2p": self.g2p}


def _digest(source: Any) -> str:
    """SHA-256 of a file's bytes, or of an inline list."""
    if isinstance(source, (list, tuple)):
        return hashlib.sha256("\n".join(map(str, source)).encode()).hexdigest()
    import fsspec

    try:
        with fsspec.open(str(source), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        raise ConfigError(f"tokens: {source} does not exist") from None


class TokenCounter:
    """Tokens of a transcript as ESPnet2's ``CommonPreprocessor`` produces them (cleaner, then the
    tokenizer, then ``TokenIDConverter``); built once per worker."""

    def __init__(self, cfg: TokenConfig):
        from espnet3_flows.frontends.espnet2_frontend import INSTALL_HINT, check_espnet_installed

        check_espnet_installed()
        try:
            from espnet2.text.token_id_converter import TokenIDConverter

            self.tokenizer = _tokenizer(cfg)
            self.cleaner = None
            if cfg.cleaner:
                from espnet2.text.cleaner import TextCleaner

                self.cleaner = TextCleaner(cfg.cleaner)
        except ImportError as exc:
            raise ConfigError(f"tokens: ESPnet2's {cfg.token_type!r} tokenizer or {cfg.cleaner or 'no'} cleaner "
                              f"needs a package that is not installed: {exc} ({INSTALL_HINT}, then that package)"
                              ) from exc
        token_list = cfg.token_list if isinstance(cfg.token_list, (list, tuple)) else str(cfg.token_list)
        self.converter = TokenIDConverter(token_list=token_list, unk_symbol="<unk>")
        self.vocabulary = len(self.converter.token_list)

    def count(self, text: str) -> int:
        """Number of token ids of ``text``."""
        if self.cleaner is not None:
            text = self.cleaner(text)
        return len(self.converter.tokens2ids(self.tokenizer.text2tokens(text)))


def _tokenizer(cfg: TokenConfig) -> Any:
    """ESPnet2's tokenizer for ``cfg``, with the arguments ESPnet2's ``build_tokenizer`` passes
    (built directly for char/word/bpe: ``build_tokenizer``'s module imports every tokenizer's
    dependencies, g2p packages included)."""
    nls = cfg.non_linguistic_symbols or None
    if cfg.token_type == "char":
        from espnet2.text.char_tokenizer import CharTokenizer

        return CharTokenizer(non_linguistic_symbols=nls, space_symbol="<space>", remove_non_linguistic_symbols=False)
    if cfg.token_type == "word":
        from espnet2.text.word_tokenizer import WordTokenizer

        return WordTokenizer(delimiter=None)
    if cfg.token_type == "bpe":
        from espnet2.text.sentencepiece_tokenizer import SentencepiecesTokenizer

        return SentencepiecesTokenizer(cfg.bpemodel, {})
    from espnet2.text.build_tokenizer import build_tokenizer

    return build_tokenizer(cfg.token_type, non_linguistic_symbols=nls, g2p_type=cfg.g2p or None)


def vocabulary_size(cfg: TokenConfig) -> int:
    """Tokens in the token list (the ``,V`` of ``text_shape.<token_type>``), as ``TokenIDConverter`` reads it."""
    if isinstance(cfg.token_list, (list, tuple)):
        return len(cfg.token_list)
    import fsspec

    with fsspec.open(str(cfg.token_list), "r", encoding="utf-8") as f:
        return sum(1 for _ in f)


__all__ = ["TOKEN_TYPES", "TokenConfig", "TokenCounter", "vocabulary_size"]
