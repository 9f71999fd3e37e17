"""Kaldi scp files published from staging name their arks where the arks are published."""

from __future__ import annotations

import kaldiio
import numpy as np
import pytest

from espnet3_flows.scp import point_scps_at_published, scp_offsets


def _stage(tmp_path):
    staging = tmp_path / "staging"
    (staging / "feats").mkdir(parents=True)
    ark, scp = staging / "feats" / "a.ark", staging / "shard" / "feats.scp"
    scp.parent.mkdir()
    with kaldiio.WriteHelper(f"ark,scp:{ark},{scp}") as w:
        for k in ("u1", "u2"):
            w(k, np.ones((3, 2), dtype=np.float32))
    return staging, ark, scp


def test_scp_lines_point_at_the_published_ark(tmp_path):
    staging, ark, scp = _stage(tmp_path)
    with open(scp, "a", encoding="utf-8") as f:
        f.write("u3 /elsewhere/b.ark:17[0:1]\n")  # not staged: left as written
    published = tmp_path / "out"
    n = point_scps_at_published([(ark, "feats/a.ark"), (scp, "shard/feats.scp")], lambda rel: str(published / rel),
                                staging)
    assert n == 2
    lines = scp.read_text().splitlines()
    assert all(line.split(" ", 1)[1].startswith(str(published / "feats" / "a.ark") + ":") for line in lines[:2])
    assert lines[2] == "u3 /elsewhere/b.ark:17[0:1]"
    assert scp_offsets("\n".join(lines), "s") == {"u1": lines[0].rsplit(":", 1)[1], "u2": lines[1].rsplit(":", 1)[1],
                                                  "u3": "17[0:1]"}
    # the rewritten scp loads once the ark is where it names
    (published / "feats").mkdir(parents=True)
    ark.rename(published / "feats" / "a.ark")
    loaded = kaldiio.load_scp(str(scp))
    np.testing.assert_array_equal(loaded["u2"], np.ones((3, 2), dtype=np.float32))


def test_an_scp_naming_an_unpublished_staged_file_is_an_error(tmp_path):
    staging, ark, scp = _stage(tmp_path)
    with pytest.raises(RuntimeError, match="feats.scp:1: .*a.ark is in the staging directory but is not published"):
        point_scps_at_published([(scp, "shard/feats.scp")], lambda rel: f"s3://b/{rel}", staging)


def test_scp_offsets_names_a_line_that_is_no_ark_reference():
    with pytest.raises(RuntimeError, match="split.x: feats.scp line 2"):
        scp_offsets("u1 a.ark:3\nu2 a.wav\n", "split.x")


def test_whole_file_lines_point_at_the_published_file(tmp_path):
    """ESPnet2's ``NpyScpWriter`` (ESPnet3's collect-stats with ``write_collected_feats``) names
    one ``.npy`` per line, no offset."""
    staging = tmp_path / "staging"
    (staging / "feats").mkdir(parents=True)
    npy, scp = staging / "feats" / "u1.npy", staging / "feats.scp"
    np.save(npy, np.arange(4.0))
    unpublished = staging / "feats" / "u2.npy"
    scp.write_text(f"u1 {npy}\nu0 /elsewhere/u0.npy\n")
    out = tmp_path / "out"
    assert point_scps_at_published([(npy, "feats/u1.npy"), (scp, "feats.scp")], lambda rel: str(out / rel), staging) == 1
    assert scp.read_text().splitlines() == [f"u1 {out / 'feats' / 'u1.npy'}", "u0 /elsewhere/u0.npy"]
    scp.write_text(f"u2 {unpublished}\n")
    with pytest.raises(RuntimeError, match="feats.scp:1: .*u2.npy is in the staging directory but is not published"):
        point_scps_at_published([(scp, "feats.scp")], lambda rel: str(out / rel), staging)
