"""``text_shape`` as ESPnet2's stage 10 writes it: token counts from ESPnet2's tokenizers, against
ESPnet2's own ``collect_stats`` fed the token ids its ``CommonPreprocessor`` makes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
import yaml

from espnet3_flows.config import ConfigError, load_config
from espnet3_flows.stats import CollectStatsConfig, CollectStatsRunner
from tests.frontends.test_espnet2_frontend import FRONTEND_CONF, FrontendOnlyModel

SR = 16000
WORDS = ["hello", "world", "speech", "data", "flows", "stats", "token", "shape", "kaldi", "recipe"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """24 utterances with transcripts of 2-7 words (one word is not in the token list's words)."""
    root = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    d = root / "data" / "train"
    d.mkdir(parents=True)
    wav_scp, text = [], []
    for i in range(24):
        wav = root / f"u{i:02d}.wav"
        sf.write(wav, (0.1 * rng.standard_normal(int(rng.uniform(0.3, 0.9) * SR))).astype(np.float32), SR)
        words = [WORDS[j] for j in rng.integers(0, len(WORDS), rng.integers(2, 8))]
        if i == 5:
            words.append("zebra")  # a z: not in the char list, counted as <unk>
        wav_scp.append(f"utt{i:02d} {wav}\n")
        text.append(f"utt{i:02d} {' '.join(words).upper()}\n")
    (d / "wav.scp").write_text("".join(wav_scp))
    (d / "text").write_text("".join(text))
    chars = sorted(set("".join(WORDS).upper()))
    (root / "tokens.char.txt").write_text("\n".join(["<blank>", "<unk>", "<space>", *chars, "<sos/eos>"]) + "\n")
    return d


def _token_list(data_dir: Path) -> Path:
    return data_dir.parents[1] / "tokens.char.txt"


def _bpe(data_dir: Path) -> tuple[Path, Path]:
    """A small sentencepiece model trained on the transcripts, and its token list as ESPnet2 makes it."""
    import sentencepiece as spm

    root = data_dir.parents[1]
    model = root / "bpe.model"
    if not model.exists():
        texts = root / "texts.txt"
        texts.write_text("".join(line.split(" ", 1)[1] for line in (data_dir / "text").read_text().splitlines(True)))
        spm.SentencePieceTrainer.train(input=str(texts), model_prefix=str(root / "bpe"), vocab_size=25,
                                       model_type="unigram", character_coverage=1.0, input_sentence_size=10000)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    tokens = root / "tokens.bpe.txt"
    tokens.write_text("\n".join(["<blank>", "<unk>", *[p for p in pieces if p not in ("<unk>", "<s>", "</s>")],
                                 "<sos/eos>"]) + "\n")
    return model, tokens


def _espnet2_with_text(data_dir: Path, out: Path, tokenizer, token_list: Path) -> Path:
    """ESPnet2's collect_stats on batches of speech and text ids (CommonPreprocessor's steps)."""
    from espnet2.asr.frontend.default import DefaultFrontend
    from espnet2.fileio.sound_scp import SoundScpReader
    from espnet2.main_funcs.collect_stats import collect_stats
    from espnet2.text.token_id_converter import TokenIDConverter
    from espnet2.train.abs_espnet_model import AbsESPnetModel

    class Model(FrontendOnlyModel, AbsESPnetModel):
        def forward(self, **batch):
            raise NotImplementedError

    converter = TokenIDConverter(str(token_list), unk_symbol="<unk>")
    texts = dict(line.split(" ", 1) for line in (data_dir / "text").read_text().splitlines())
    reader = SoundScpReader(str(data_dir / "wav.scp"), always_2d=False)
    batches = []
    for key in sorted(reader.keys()):
        wave = torch.from_numpy(np.asarray(reader[key][1], dtype=np.float32))[None]
        ids = torch.tensor(converter.tokens2ids(tokenizer.text2tokens(texts[key])))[None]
        batches.append(([key], {"speech": wave, "speech_lengths": torch.tensor([wave.shape[1]]),
                                "text": ids, "text_lengths": torch.tensor([ids.shape[1]])}))
    collect_stats(model=Model(DefaultFrontend(**FRONTEND_CONF)).eval(), train_iter=batches, valid_iter=batches[:1],
                  output_dir=out, ngpu=0, log_interval=None, write_collected_feats=False)
    return out / "train"


def _ours(data_dir: Path, out: Path, *extra: str):
    cfg = load_config(CollectStatsConfig, overrides=[
        f"manifests.train={data_dir}", f"output_dir={out}", "parallel.env=serial", "frontend.type=espnet2",
        *[f"frontend.conf.{k}={v}" for k, v in FRONTEND_CONF.items()], *extra])
    return CollectStatsRunner(cfg, "train").run(progress=False)


def _lines(path: Path) -> list[str]:
    return sorted(path.read_text().splitlines())


def test_char_text_shape_equals_espnet2s(data_dir, tmp_path):
    from espnet2.text.char_tokenizer import CharTokenizer

    tokens = _token_list(data_dir)
    ref = _espnet2_with_text(data_dir, tmp_path / "espnet2", CharTokenizer(non_linguistic_symbols=None), tokens)
    out = tmp_path / "ours"
    summary = _ours(data_dir, out, "tokens.token_type=char", f"tokens.token_list={tokens}").merged
    assert {"text_shape", "text_shape.char"} <= set(summary["files"])
    assert _lines(out / "train/text_shape") == _lines(ref / "text_shape")
    assert _lines(out / "train/speech_shape") == _lines(ref / "speech_shape")
    assert (out / "train/batch_keys").read_text() == (ref / "batch_keys").read_text() == "speech\ntext\n"
    vocabulary = len(tokens.read_text().splitlines())
    # asr.sh: awk -v N="$(<token_list wc -l)" '{ print $0 "," N }' text_shape > text_shape.char
    assert _lines(out / "train/text_shape.char") == sorted(f"{line},{vocabulary}" for line in _lines(ref / "text_shape"))
    # ESPnet2's batch sampler takes our shape files as train_shape_file
    from espnet2.samplers.build_batch_sampler import build_batch_sampler

    sampler = build_batch_sampler(type="numel", batch_size=4, batch_bins=200_000,
                                  shape_files=[str(out / "train/speech_shape"), str(out / "train/text_shape.char")])
    assert sorted(k for batch in sampler for k in batch) == sorted(line.split()[0] for line in _lines(ref / "text_shape"))


def test_bpe_text_shape_equals_espnet2s_and_comes_from_the_model_config(data_dir, tmp_path):
    from espnet2.text.sentencepiece_tokenizer import SentencepiecesTokenizer

    model, tokens = _bpe(data_dir)
    ref = _espnet2_with_text(data_dir, tmp_path / "espnet2", SentencepiecesTokenizer(str(model)), tokens)
    config = tmp_path / "exp/asr_train/config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(yaml.safe_dump({"frontend": "default", "frontend_conf": FRONTEND_CONF, "token_type": "bpe",
                                      "bpemodel": str(model), "token_list": tokens.read_text().splitlines(),
                                      "cleaner": None, "g2p": None}))
    out = tmp_path / "ours"
    cfg = load_config(CollectStatsConfig, overrides=[
        f"manifests.train={data_dir}", f"output_dir={out}", "parallel.env=serial", "frontend.type=espnet2",
        f"frontend.espnet_config={config}"])
    assert cfg.tokens.token_type == "bpe" and cfg.tokens.bpemodel == str(model)
    off = load_config(CollectStatsConfig, overrides=["frontend.type=espnet2", f"frontend.espnet_config={config}",
                                                     "tokens.token_type=none"])
    assert not off.tokens.enabled  # a TSV without transcripts can still use the model's frontend
    CollectStatsRunner(cfg, "train").run(progress=False)
    assert _lines(out / "train/text_shape") == _lines(ref / "text_shape")
    assert (out / "train/text_shape.bpe").exists()


def test_missing_transcript_is_a_bad_item_and_settings_are_checked(data_dir, tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "wav.scp").write_text((data_dir / "wav.scp").read_text())
    (d / "text").write_text("".join(line + "\n" for line in (data_dir / "text").read_text().splitlines()[1:]))
    tokens = _token_list(data_dir)
    out = tmp_path / "skip"
    summary = _ours(d, out, "tokens.token_type=char", f"tokens.token_list={tokens}", "on_error=skip").merged
    assert summary["utterances"] == 23 and summary["skipped"] == 1
    assert "utt00" in (out / "train/skipped.tsv").read_text() and "no transcript" in (out / "train/skipped.tsv").read_text()
    with pytest.raises(ConfigError, match="tokens.token_type=char needs tokens.token_list"):
        load_config(CollectStatsConfig, overrides=["tokens.token_type=char"])
    with pytest.raises(ConfigError, match="tokens.token_type=bpe needs tokens.bpemodel"):
        load_config(CollectStatsConfig, overrides=["tokens.token_type=bpe", f"tokens.token_list={tokens}"])
    with pytest.raises(ConfigError, match="tokens.token_type must be one of"):
        load_config(CollectStatsConfig, overrides=["tokens.token_type=letters"])
