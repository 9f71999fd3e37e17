"""Collect-stats on bad data, one test per kind: a clear error under ``fail``, a recorded skip under ``skip``."""

from __future__ import annotations

import errno
import json
import os
import tracemalloc
from pathlib import Path

import fsspec.implementations.local
import kaldiio
import numpy as np
import pytest
import soundfile as sf

from espnet3_flows.config import load_config
from espnet3_flows.inputs.records import ManifestError
from espnet3_flows.errors import ItemError, ShardFailure, is_item_os_error
from espnet3_flows.stats import CollectStatsConfig, CollectStatsRunner
from tests.support.audio_files import sparse_wav

SR = 16000
BAD_LINE = 4  # every manifest below: a comment, two good lines, the bad line, a good line


def _tone(freq: float, seconds: float, sr: int = SR, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    cols = [0.3 * np.sin(2 * np.pi * freq * (k + 1) * t) for k in range(channels)]
    return np.stack(cols, axis=1).astype(np.float32) if channels > 1 else cols[0].astype(np.float32)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> list[tuple[str, str]]:
    root = tmp_path_factory.mktemp("good")
    rows = []
    for k, freq in enumerate((220.0, 550.0, 1300.0)):
        path = root / f"good{k}.wav"
        sf.write(path, _tone(freq, 0.3 + 0.1 * k), SR, subtype="PCM_16")
        rows.append((f"good-{k}", str(path)))
    return rows


def _manifest_text(good: list[tuple[str, str]], bad_line: str) -> str:
    lines = ["# utt_id\twav", *(f"{u}\t{p}" for u, p in good[:2]), bad_line, f"{good[2][0]}\t{good[2][1]}"]
    return "\n".join(lines) + "\n"


def _config(manifest: Path, out: Path, *overrides: str) -> CollectStatsConfig:
    return load_config(CollectStatsConfig, overrides=[
        f"manifests.train={manifest}", f"output_dir={out}", "parallel.env=serial", "batch_size=2", *overrides])


def _run(cfg: CollectStatsConfig):
    runner = CollectStatsRunner(cfg, "train")
    return runner.run(progress=False)


def _npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def _skipped(out: Path) -> list[list[str]]:
    lines = (out / "train" / "skipped.tsv").read_text().splitlines()
    assert lines[0] == "split\tutt_id\tline\tpath\treason"
    return [line.split("\t") for line in lines[1:]]


@pytest.fixture(scope="module")
def clean(good, tmp_path_factory) -> Path:
    """Outputs of the good utterances alone: what a skip run must equal."""
    root = tmp_path_factory.mktemp("clean")
    manifest = root / "train.tsv"
    manifest.write_text("".join(f"{u}\t{p}\n" for u, p in good))
    _run(_config(manifest, root / "out"))
    return root / "out"


def _check_fail_and_skip(tmp_path: Path, good, clean: Path, bad_line: str, utt_id: str,
                         reason: str, *overrides: str, error: type[Exception] = ItemError,
                         where: str | None = None, duplicate: bool = False) -> None:
    tmp_path.mkdir(exist_ok=True)
    manifest = tmp_path / "train.tsv"
    manifest.write_bytes(_manifest_text(good, bad_line).encode("utf-8", "surrogateescape"))

    with pytest.raises(error) as info:
        _run(_config(manifest, tmp_path / "fail", *overrides))
    msg = str(info.value)
    assert "train" in msg
    assert repr(utt_id) in msg
    assert (where or f"line {BAD_LINE}") in msg
    assert reason in msg, msg
    assert not (tmp_path / "fail" / "train" / "summary.json").exists()

    out = tmp_path / "skip"
    outcome = _run(_config(manifest, out, "on_error=skip", *overrides))
    rows = _skipped(out)
    assert len(rows) == 1
    split, uid, line, _path, why = rows[0]
    assert (split, uid, line) == ("train", utt_id, str(BAD_LINE))
    assert reason in why
    summary = json.loads((out / "train" / "summary.json").read_text())
    assert summary["skipped"] == 1 == outcome.merged["skipped"]
    assert summary["utterances"] == 3
    for name in ("feats_shape", "speech_shape"):
        text = (out / "train" / name).read_text()
        assert duplicate or utt_id not in text
        assert text == (clean / "train" / name).read_text()
    ours, ref = _npz(out / "train" / "feats_stats.npz"), _npz(clean / "train" / "feats_stats.npz")
    assert int(ours["count"]) == int(ref["count"])
    np.testing.assert_allclose(ours["sum"], ref["sum"], rtol=1e-12)
    np.testing.assert_allclose(ours["sum_square"], ref["sum_square"], rtol=1e-12)


# ---- bad audio --------------------------------------------------------------------------------
def test_missing_file(tmp_path, good, clean):
    path = tmp_path / "nowhere" / "missing.wav"
    _check_fail_and_skip(tmp_path, good, clean, f"bad-missing\t{path}", "bad-missing", "audio file not found")


def _permanent_os_error(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A path whose opening fails the same way every time, and the errno it gives."""
    if kind == "symlink-loop":
        a, b = tmp_path / "loop-a.wav", tmp_path / "loop-b.wav"
        a.symlink_to(b)
        b.symlink_to(a)
        return a, "ELOOP"
    if kind == "name-too-long":
        return tmp_path / ("x" * 300 + ".wav"), "ENAMETOOLONG"
    plain = tmp_path / "plain.wav"
    plain.write_bytes(b"not a directory")
    return plain / "inside.wav", "ENOTDIR"


@pytest.mark.parametrize("kind", ["symlink-loop", "name-too-long", "not-a-directory"])
def test_os_errors_permanent_for_one_file_are_bad_items(tmp_path, good, clean, kind):
    path, name = _permanent_os_error(tmp_path, kind)
    _check_fail_and_skip(tmp_path, good, clean, f"bad-os\t{path}", "bad-os", "cannot open audio file: ", "retries=2")
    assert name in _skipped(tmp_path / "skip")[0][4]


class _FailingStore(fsspec.implementations.local.LocalFileSystem):
    """Local files behind ``failing://``, where opening a path whose name holds an errno name
    (``...EIO...``) fails with that errno: a store failing under one file (fsspec's own open path
    and the package's code run unchanged)."""

    protocol = "failing"
    opens: list[str] = []

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("failing://"))

    def _open(self, path, mode="rb", **kwargs):
        name = os.path.basename(path)
        for code in ("EIO", "ESTALE", "ETIMEDOUT", "ECONNRESET"):
            if code in name:
                type(self).opens.append(name)
                raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)), path)
        return super()._open(path, mode, **kwargs)


def _store_failing_manifest(tmp_path: Path, good, code: str) -> Path:
    fsspec.register_implementation("failing", _FailingStore, clobber=True)
    _FailingStore.opens.clear()
    flaky = tmp_path / f"flaky-{code}.wav"
    flaky.write_bytes(Path(good[0][1]).read_bytes())
    manifest = tmp_path / "train.tsv"
    manifest.write_text(_manifest_text(good, f"bad-store\tfailing://{flaky}"))
    return manifest


def _assert_shard_failed_on_the_store(exc: BaseException, out: Path, code: str) -> None:
    assert isinstance(exc, ShardFailure) and not isinstance(exc, ItemError), exc  # no item blamed
    assert f"[Errno {getattr(errno, code)}]" in str(exc)
    assert not (out / "train" / "skipped.tsv").exists()
    assert not (out / "train" / "summary.json").exists()


@pytest.mark.parametrize("code", ["EIO", "ESTALE", "ETIMEDOUT", "ECONNRESET"])
@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_os_errors_of_the_store_fail_the_shard_not_the_item(tmp_path, good, code, on_error):
    manifest = _store_failing_manifest(tmp_path, good, code)
    with pytest.raises(ShardFailure) as info:
        _run(_config(manifest, tmp_path / "out", f"on_error={on_error}"))
    _assert_shard_failed_on_the_store(info.value, tmp_path / "out", code)


@pytest.mark.prefect
@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_store_errors_are_retried_by_the_flow_and_permanent_ones_are_not(prefect_harness, tmp_path, good, on_error):
    from espnet3_flows.orchestration.flows import run_job

    manifest = _store_failing_manifest(tmp_path, good, "EIO")
    loop = tmp_path / "loop.wav"
    loop.symlink_to(loop)
    manifest.write_text(manifest.read_text() + f"bad-loop\t{loop}\n")
    cfg = {"manifests": {"train": str(manifest)}, "output_dir": str(tmp_path / "out"), "on_error": on_error,
           "retries": 2, "retry_delay_seconds": 0.01, "shard_size": 100, "parallel": {"env": "serial"}}
    with pytest.raises(ShardFailure) as info:
        run_job("collect_stats", cfg, progress=False)
    if on_error == "fail":  # the loop or the store, whichever the shard meets first, ends it
        assert "bad-loop" in str(info.value) or "[Errno 5]" in str(info.value)
        return
    _assert_shard_failed_on_the_store(info.value, tmp_path / "out", "EIO")
    assert len(_FailingStore.opens) == 3  # the first try and both retries reached the store
    # and once the store answers, the loop is a skipped item, not a failure
    manifest.write_text(manifest.read_text().replace("failing://", ""))
    summary = run_job("collect_stats", cfg, progress=False)["train"]
    assert summary["skipped"] == 1 and summary["utterances"] == 4
    assert "ELOOP" in (tmp_path / "out" / "train" / "skipped.tsv").read_text()


def test_errno_classes():
    for code in ("ENOENT", "ELOOP", "ENAMETOOLONG", "ENOTDIR", "EISDIR", "EACCES", "EPERM"):
        assert is_item_os_error(OSError(getattr(errno, code), "x")), code
    for code in ("EIO", "ESTALE", "ETIMEDOUT", "ECONNRESET", "EMFILE", "ENOMEM", "EAGAIN", "ENOSPC"):
        assert not is_item_os_error(OSError(getattr(errno, code), "x")), code
    assert not is_item_os_error(OSError("a network client's error without an errno"))
    assert not is_item_os_error(ValueError("not an OSError"))


def test_corrupt_file(tmp_path, good, clean):
    path = tmp_path / "corrupt.wav"
    path.write_bytes(np.random.default_rng(0).bytes(8000))
    _check_fail_and_skip(tmp_path, good, clean, f"bad-corrupt\t{path}", "bad-corrupt", "cannot decode audio")


def test_truncated_wav_header(tmp_path, good, clean):
    path = tmp_path / "truncated.wav"
    sf.write(path, _tone(300, 0.2), SR, subtype="PCM_16")
    path.write_bytes(path.read_bytes()[:30])
    _check_fail_and_skip(tmp_path, good, clean, f"bad-trunc\t{path}", "bad-trunc", "cannot decode audio")


def test_zero_length_audio(tmp_path, good, clean):
    path = tmp_path / "empty.wav"
    sf.write(path, np.zeros(0, dtype=np.float32), SR, subtype="PCM_16")
    assert sf.info(path).frames == 0
    _check_fail_and_skip(tmp_path, good, clean, f"bad-empty\t{path}", "bad-empty", "zero-length audio")


def test_audio_shorter_than_one_frame(tmp_path, good, clean):
    # 100 samples (6 ms): lhotse's framing reads past the end and torch raises a RuntimeError,
    # which would fail the whole shard; it is a bad item like any other
    path = tmp_path / "blip.wav"
    sf.write(path, _tone(300, 100 / SR), SR, subtype="PCM_16")
    _check_fail_and_skip(tmp_path, good, clean, f"bad-blip\t{path}", "bad-blip", "shorter than one fbank frame")


def test_nan_samples(tmp_path, good, clean):
    path = tmp_path / "nan.wav"
    x = _tone(300, 0.2)
    x[100:110] = np.nan
    sf.write(path, x, SR, subtype="FLOAT")
    assert np.isnan(sf.read(path)[0]).sum() == 10
    _check_fail_and_skip(tmp_path, good, clean, f"bad-nan\t{path}", "bad-nan", "NaN or Inf")


def test_wrong_sampling_rate_is_resampled(tmp_path, good):
    path = tmp_path / "rate8k.wav"
    sf.write(path, _tone(300, 0.25, sr=8000), 8000, subtype="PCM_16")
    manifest = tmp_path / "train.tsv"
    manifest.write_text(_manifest_text(good, f"utt-8k\t{path}"))
    outcome = _run(_config(manifest, tmp_path / "out"))
    assert outcome.merged["skipped"] == 0 and outcome.merged["utterances"] == 4
    speech = dict(line.split(" ") for line in (tmp_path / "out" / "train" / "speech_shape").read_text().splitlines())
    assert int(speech["utt-8k"]) == 2 * 2000
    feats = dict(line.split(" ") for line in (tmp_path / "out" / "train" / "feats_shape").read_text().splitlines())
    assert feats["utt-8k"] in ("25,80", "24,80", "26,80")  # 0.25 s of 10 ms frames


def test_three_channel_audio(tmp_path, good, clean):
    from lhotse import Fbank, FbankConfig

    path = tmp_path / "three.wav"
    x = _tone(300, 0.3, channels=3)
    sf.write(path, x, SR, subtype="FLOAT")
    manifest = tmp_path / "train.tsv"
    manifest.write_text(_manifest_text(good, f"utt-3ch\t{path}"))
    out = tmp_path / "mean"
    _run(_config(manifest, out, "write_collected_feats=true"))
    feats = dict(kaldiio.load_scp(str(out / "train" / "collect_feats" / "feats.scp")))
    fbank = Fbank(FbankConfig(sampling_rate=SR, num_mel_bins=80, dither=0.0))
    mean = x.astype(np.float64).mean(axis=1).astype(np.float32)
    np.testing.assert_allclose(feats["utt-3ch"], fbank.extract(mean, SR), rtol=1e-5, atol=1e-4)
    assert np.abs(feats["utt-3ch"] - fbank.extract(np.ascontiguousarray(x[:, 0]), SR)).max() > 1.0

    # a channel the file does not have is a clear error (or a skip)
    _check_fail_and_skip(tmp_path / "ch5", good, clean, f"utt-3ch\t{path}", "utt-3ch",
                         "channel 5 requested but the audio has 3 channel(s)", "frontend.channel=5")


@pytest.mark.parametrize("frontend", ["fbank", "none"])
def test_two_hour_file_is_refused_from_its_header(tmp_path, good, clean, frontend):
    path = tmp_path / "two_hours.wav"
    size = sparse_wav(path, 2 * 3600)
    assert sf.info(path).duration == 7200.0
    # The run is serial, in this process: tracemalloc sees every numpy buffer it allocates (numpy
    # reports its data buffers to it), so a decode of the 2-hour file (230 MB as int16) shows as
    # this test's own peak, whatever earlier tests did to the process's RSS.
    tracemalloc.start()
    reason = "duration 7200.0 s exceeds max_duration 3600 s"
    if frontend == "fbank":
        _check_fail_and_skip(tmp_path, good, clean, f"utt-2h\t{path}", "utt-2h", reason)
    else:
        manifest = tmp_path / "train.tsv"
        manifest.write_text(_manifest_text(good, f"utt-2h\t{path}"))
        with pytest.raises(ItemError, match=reason):
            _run(_config(manifest, tmp_path / "fail", "frontend.type=none"))
        outcome = _run(_config(manifest, tmp_path / "skip", "frontend.type=none", "on_error=skip"))
        assert outcome.merged["skipped"] == 1
        assert [r[1] for r in _skipped(tmp_path / "skip")] == ["utt-2h"]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < size // 4, f"peak traced allocation {peak} bytes: the 2-hour file was decoded"
    os.unlink(path)


# ---- bad manifests ------------------------------------------------------------------------------
def test_manifest_line_with_too_few_fields(tmp_path, good, clean):
    _check_fail_and_skip(tmp_path, good, clean, "lonely-utt", "lonely-utt", "got 1 field(s)",
                         error=ManifestError, where=f"train.tsv:{BAD_LINE}")


def test_manifest_line_with_invalid_utf8(tmp_path, good, clean):
    bad = "utt-latin1\t/data/caf\udce9.wav"  # a Latin-1 byte 0xE9 where UTF-8 is expected
    _check_fail_and_skip(tmp_path, good, clean, bad, "utt-latin1", "not valid UTF-8",
                         error=ManifestError, where=f"train.tsv:{BAD_LINE}")


def test_duplicate_utt_ids(tmp_path, good, clean):
    first_id, first_path = good[0]
    _check_fail_and_skip(tmp_path, good, clean, f"{first_id}\t{good[1][1]}", first_id,
                         "duplicate utterance id 'good-0' (first on line 2)",
                         error=ManifestError, where=f"train.tsv:{BAD_LINE}", duplicate=True)


@pytest.mark.parametrize("on_error", ["fail", "skip"])
@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_empty_manifest_is_always_an_error(tmp_path, on_error, text):
    manifest = tmp_path / "train.tsv"
    manifest.write_text(text)
    cfg = _config(manifest, tmp_path / "out", f"on_error={on_error}")
    with pytest.raises(ManifestError, match=r"split 'train': manifest .*train\.tsv has no usable utterance"):
        _run(cfg)
    assert not (tmp_path / "out").exists()


def test_manifest_of_only_bad_lines_is_an_error_even_when_skipping(tmp_path):
    manifest = tmp_path / "train.tsv"
    manifest.write_text("a/b\t/x.wav\n..\t/y.wav\n")
    with pytest.raises(ManifestError, match="no usable utterance"):
        _run(_config(manifest, tmp_path / "out", "on_error=skip"))


HOSTILE_TSV = ["a/b", "..", "-x", "../escape", "a\\b", "a\0b", "a\rb", "a b", "/abs"]
HOSTILE_JSONL = ["a\tb", "a\nb", "a\0b", "a\\b", "a/b", "..", "-x"]


@pytest.mark.parametrize("utt_id", HOSTILE_TSV, ids=repr)
def test_hostile_utt_ids_in_tsv_are_rejected_before_any_path_is_built(tmp_path, good, utt_id):
    manifest = tmp_path / "train.tsv"
    manifest.write_text(_manifest_text(good, f"{utt_id}\t{good[0][1]}"), newline="")
    with pytest.raises(ManifestError) as info:
        _run(_config(manifest, tmp_path / "fail", "write_collected_feats=true"))
    assert repr(utt_id) in str(info.value) and f"train.tsv:{BAD_LINE}" in str(info.value)
    assert not (tmp_path / "fail").exists()

    out = tmp_path / "skip"
    outcome = _run(_config(manifest, out, "write_collected_feats=true", "on_error=skip"))
    assert outcome.merged["skipped"] == 1 and outcome.merged["utterances"] == 3
    rows = _skipped(out)
    assert len(rows) == 1 and rows[0][2] == str(BAD_LINE) and "manifest: utterance id" in rows[0][4]
    created = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")}
    assert all(p.startswith(("skip", "train.tsv")) for p in created), created
    assert not (tmp_path / "escape").exists() and not (tmp_path / "skip" / "escape").exists()
    assert utt_id not in (out / "train" / "feats_shape").read_text()
    scp_keys = [line.split(" ")[0] for line in (out / "train" / "collect_feats" / "feats.scp").read_text().splitlines()]
    assert scp_keys == [u for u, _ in good]  # manifest order (the bad line left out)


def test_hostile_utt_ids_in_lhotse_manifest(tmp_path, good):
    from lhotse import CutSet, MonoCut, Recording

    rec = Recording.from_file(good[0][1], recording_id="rec0")
    for k, utt_id in enumerate(HOSTILE_JSONL):
        path = tmp_path / f"cuts{k}.jsonl"
        CutSet.from_cuts([MonoCut(id="fine-0", start=0.0, duration=rec.duration, channel=0, recording=rec),
                          MonoCut(id=utt_id, start=0.0, duration=rec.duration, channel=0, recording=rec)]
                         ).to_file(path)
        with pytest.raises(ManifestError) as info:
            _run(_config(path, tmp_path / "fail"))
        assert repr(utt_id) in str(info.value) and f"cuts{k}.jsonl:2" in str(info.value)
        outcome = _run(_config(path, tmp_path / f"skip{k}", "on_error=skip"))
        assert outcome.merged["skipped"] == 1 and outcome.merged["utterances"] == 1
    assert not (tmp_path / "fail").exists()


def test_switching_on_error_computes_only_the_shards_with_a_bad_item(tmp_path, good):
    """``on_error`` is not in a shard's hash: after a ``fail`` run stopped on a bad item, ``skip``
    reuses every shard the fail run finished; a later ``fail`` run computes the shard that left
    an item out again (and stops on it), not the others."""
    from espnet3_flows.parallel.shard_lifecycle import DONE

    lines = [f"good-{k}\t{good[k % 3][1]}" for k in range(12)] + [f"bad-missing\t{tmp_path / 'missing.wav'}"]
    manifest = tmp_path / "train.tsv"
    manifest.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"

    def run(policy: str):
        return _run(_config(manifest, out, f"on_error={policy}", "shard_size=2"))

    with pytest.raises(ItemError, match="bad-missing"):
        run("fail")
    done_by_fail = len(list(out.rglob(DONE)))
    skip = run("skip")
    assert 1 <= done_by_fail < len(skip.shards)
    assert (skip.cached, skip.computed) == (done_by_fail, len(skip.shards) - done_by_fail)
    assert skip.merged["skipped"] == 1 and skip.merged["utterances"] == 12
    again = run("skip")
    assert (again.cached, again.computed) == (len(skip.shards), 0)

    with pytest.raises(ItemError, match="bad-missing"):  # the shard done under skip is not done under fail
        run("fail")
    last = run("skip")
    assert last.computed <= 1 and last.cached >= len(skip.shards) - 1
    counts = ("shards_computed", "shards_cached", "compute_seconds")
    assert {k: v for k, v in last.merged.items() if k not in counts} == \
        {k: v for k, v in skip.merged.items() if k not in counts}
