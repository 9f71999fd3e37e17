"""Tests for the ESPnet2 x-vector output writers: .pt files, kaldi ark/scp, speaker means."""

from __future__ import annotations

from pathlib import Path

import kaldiio
import numpy as np
import pytest
import torch

from espnet3_flows.xvector import (
    speaker_means,
    write_speaker_xvector_ark_scp,
    write_utterance_tensors,
    write_xvector_ark_scp,
)

HOSTILE_IDS = ["", "a/b", "..", "a..b", "a\\b", "a\0b", "a\nb", "a\tb", "-rf", "../../etc/passwd"]


def embeddings(n: int = 5, dim: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"utt{i:02d}": rng.standard_normal(dim).astype(np.float32) for i in range(n)}


def test_utterance_tensors_load_with_weights_only(tmp_path: Path) -> None:
    emb = embeddings()
    paths = write_utterance_tensors(tmp_path / "out", emb)
    assert sorted(p.name for p in paths) == sorted(f"{k}.pt" for k in emb)
    for key, value in emb.items():
        t = torch.load(tmp_path / "out" / f"{key}.pt", weights_only=True)
        assert t.dtype == torch.float32 and tuple(t.shape) == (8,)
        np.testing.assert_array_equal(t.numpy(), value)
    assert not list((tmp_path / "out").glob(".*"))  # no temporary files left


@pytest.mark.parametrize("bad", HOSTILE_IDS)
def test_hostile_ids_rejected_before_writing(tmp_path: Path, bad: str) -> None:
    emb = {"good": np.ones(4, np.float32), bad: np.ones(4, np.float32)}
    with pytest.raises(ValueError):
        write_utterance_tensors(tmp_path / "out", emb)
    with pytest.raises(ValueError):
        write_xvector_ark_scp(tmp_path / "ark", emb)
    assert not (tmp_path / "out").exists() and not (tmp_path / "ark").exists()


@pytest.mark.parametrize("value", [np.ones((2, 4)), np.array([1.0, np.inf]), np.array(["a", "b"])])
def test_bad_vectors_rejected_naming_the_utterance(tmp_path: Path, value: np.ndarray) -> None:
    with pytest.raises(ValueError, match="'utt7'"):
        write_utterance_tensors(tmp_path, {"utt7": value})


def test_ark_scp_round_trip_sorted(tmp_path: Path) -> None:
    emb = dict(reversed(list(embeddings().items())))
    ark, scp = write_xvector_ark_scp(tmp_path / "out", emb)
    assert (ark.name, scp.name) == ("xvector.ark", "xvector.scp")
    keys = [line.split()[0] for line in scp.read_text().splitlines()]
    assert keys == sorted(emb)
    assert all(line.split()[1].startswith(str(ark) + ":") for line in scp.read_text().splitlines())
    loaded = kaldiio.load_scp(str(scp))
    for key, value in emb.items():
        np.testing.assert_array_equal(loaded[key], value)
    assert dict(kaldiio.load_ark(str(ark))).keys() == emb.keys()


def test_speaker_means_in_float64(tmp_path: Path) -> None:
    emb = {
        "u1": np.array([1.0, 2.0], np.float32),
        "u2": np.array([3.0, 4.0], np.float32),
        "u3": np.array([1e8, 1.0], np.float32),
        "u4": np.array([1.0, 1.0], np.float32),
    }
    utt2spk = {"u1": "s1", "u2": "s1", "u3": "s2", "u4": "s2", "u9": "s3"}
    means = speaker_means(emb, utt2spk)
    assert list(means) == ["s1", "s2"]
    np.testing.assert_array_equal(means["s1"], [2.0, 3.0])
    np.testing.assert_array_equal(means["s2"], np.float32([(1e8 + 1.0) / 2, 1.0]))
    assert all(v.dtype == np.float32 for v in means.values())
    ark, scp = write_speaker_xvector_ark_scp(tmp_path, means)
    assert (ark.name, scp.name) == ("spk_xvector.ark", "spk_xvector.scp")
    loaded = kaldiio.load_scp(str(scp))
    assert sorted(loaded) == ["s1", "s2"]
    np.testing.assert_array_equal(loaded["s2"], means["s2"])


def test_speaker_means_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'u2'.*no speaker"):
        speaker_means({"u1": np.ones(2), "u2": np.ones(2)}, {"u1": "s"})
    with pytest.raises(ValueError, match="'u2'.*dimension"):
        speaker_means({"u1": np.ones(2), "u2": np.ones(3)}, {"u1": "s", "u2": "s"})
    with pytest.raises(ValueError, match="whitespace"):
        write_speaker_xvector_ark_scp(tmp_path, {"spk 1": np.ones(2)})
