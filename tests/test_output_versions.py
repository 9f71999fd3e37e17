"""Each job's outputs on a fixed input, against the digest recorded for the job's output version.

Shard hashes hold each job's version (``hash_config()["job"]``, e.g. ``collect_stats/1``) and
:data:`~espnet3_flows.hashing.FORMAT_VERSION`, not the package's version: a release recomputes
nothing unless outputs change. So a change that changes a job's outputs must move its version (old
shards are then recomputed instead of merged with new ones); this test fails when they change
without it. Then: bump the version in the job's ``hash_config`` and record the new digest here.

The digest reads the published outputs (arrays from ``.npz``, Kaldi ``.ark`` and ``.pt`` files,
rounded to 5 significant digits; shape, key and speaker lists as text), not file names or paths.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from espnet3_flows.hashing import code_salt

#: job version -> digest of its outputs on ``corpus`` below (update together with the version)
GOLDEN = {
    "collect_stats/1": "d94e039a10aa4a1f20a56a77559b80e7c860521e3db2cb14a67f7248d4851fdc",
    "extract_features/1": "b6eb8596a6859c62a35368b12e4bbde0eadc38e2a954dc20aff95fe2a7a073a7",
    "xvector/1": "2e364054771334edd0c8330508623c083a6acc4721afc4ce457c8de3b0803a66",
}
TEXT_OUTPUTS = ("_shape", "_keys", "utt2spk", "skipped.tsv", "stats_keys", "batch_keys")


def _arrays(path: Path) -> list[tuple[str, Any]]:
    if path.suffix == ".npz":
        with np.load(path) as z:
            return [(k, z[k]) for k in z.files]
    if path.suffix == ".ark":
        import kaldiio

        return list(kaldiio.load_ark(str(path)))
    if path.suffix == ".pt" and path.stem != "lhotse_global_mvn":
        import torch

        value = torch.load(path, map_location="cpu", weights_only=True)
        return [(path.stem, np.asarray(value))]
    return []


def outputs_digest(root: Path) -> str:
    """The digest of the published outputs under ``root``."""
    entries: list[str] = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "shards" not in p.parts):
        rel = path.relative_to(root)
        for key, value in _arrays(path):
            arr = np.asarray(value, dtype=np.float64).ravel()
            entries.append(f"{rel.parent}/{key}:{np.asarray(value).shape}:" + ",".join(f"{x:.5g}" for x in arr))
        if path.name.endswith(TEXT_OUTPUTS):
            entries.append(f"{rel}:{path.read_text()}")
    entries.sort()
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from espnet3_flows.inputs.demo import make_demo_corpus

    return make_demo_corpus(tmp_path_factory.mktemp("corpus"), n_utts=12, splits={"train": 1.0})["train"]


def _collect_stats(manifest: Path, out: Path) -> Any:
    from espnet3_flows.stats.job import CollectStatsConfig, CollectStatsRunner

    return CollectStatsRunner(CollectStatsConfig(manifests={"train": str(manifest)}, output_dir=str(out),
                                                 shard_size=4), "train")


def _extract_features(manifest: Path, out: Path) -> Any:
    from espnet3_flows.features.job import ExtractFeaturesConfig, FeatureRunner

    return FeatureRunner(ExtractFeaturesConfig(manifests={"train": str(manifest)}, output_dir=str(out),
                                               shard_size=4), "train")


def _xvector(manifest: Path, out: Path) -> Any:
    from espnet3_flows.xvector.job import XVectorConfig, XVectorJobConfig, XVectorRunner
    from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir

    model = build_random_ecapa_dir(out.parent / "ecapa", seed=0)
    return XVectorRunner(XVectorJobConfig(manifests={"train": str(manifest)}, output_dir=str(out), shard_size=4,
                                          xvector=XVectorConfig(pretrained_model=str(model))), "train")


JOBS: dict[str, Callable[[Path, Path], Any]] = {
    "collect_stats/1": _collect_stats, "extract_features/1": _extract_features, "xvector/1": _xvector}


@pytest.mark.parametrize("version", list(JOBS))
def test_outputs_change_only_with_the_jobs_version(version, corpus, tmp_path):
    runner = JOBS[version](corpus, tmp_path / "out")
    assert runner.hash_config()["job"] == version, (
        f"the job's version moved to {runner.hash_config()['job']!r}: record its outputs' digest in GOLDEN")
    runner.run(parallel={"env": "serial"}, progress=False)
    digest = outputs_digest(tmp_path / "out")
    assert digest != outputs_digest(tmp_path / "empty"), "no outputs were read"
    assert digest == GOLDEN[version], (
        f"{version}'s outputs changed (digest {digest}) while its version did not: bump the version in its "
        f"hash_config() so that shards computed before are recomputed, not merged with new ones, and record "
        f"the new digest in GOLDEN")


def test_the_salt_holds_no_package_version(monkeypatch):
    import espnet3_flows

    salt = code_salt()
    assert salt == "espnet3_flows=0.1.0;format=2;"  # the shards computed so far keep their hashes
    monkeypatch.setattr(espnet3_flows, "__version__", "9.9.9")
    assert code_salt() == salt
