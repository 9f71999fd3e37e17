"""The extract-xvectors flow on a process LocalCluster, and its command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kaldiio
import numpy as np
import pytest
import s3fs
import torch

from espnet3_flows.orchestration.flows import run_job
from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir
from tests.support.servers import cli_env
from tests.support.floats import assert_same_floats

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.prefect, pytest.mark.dask]


@pytest.fixture(scope="module")
def ecapa_dir(tmp_path_factory) -> Path:
    return build_random_ecapa_dir(tmp_path_factory.mktemp("ecapa") / "model")


def test_xvector_flow_on_local_cluster(prefect_harness, ecapa_dir, demo_corpus, tmp_path):
    cfg = {"xvector": {"pretrained_model": str(ecapa_dir), "manifest_paths": demo_corpus, "splits": ["valid"],
                       "save_path": str(tmp_path / "xv"), "batch_size": 4},
           "shard_size": 4, "parallel": {"env": "local", "n_workers": 2}}
    summary = run_job("extract_xvectors", cfg, progress=False)["valid"]
    assert summary["utterances"] == 12 and summary["shards_computed"] == summary["shards"] > 1 and summary["speakers"] == 3
    split_dir = tmp_path / "xv" / "xvector" / "valid"
    scp = kaldiio.load_scp(str(split_dir / "xvector.scp"))
    assert len(scp) == 12
    for key, vec in scp.items():
        assert torch.equal(torch.load(split_dir / f"{key}.pt", weights_only=True), torch.from_numpy(vec.copy()))
    assert not (tmp_path / "xv" / "xvector" / "train").exists()  # only the selected split
    again = run_job("extract_xvectors", cfg, progress=False)["valid"]
    assert again["shards_cached"] == summary["shards"] and again["shards_computed"] == 0
    # the cluster's x-vectors are those of a serial run (other processes: within float tolerance)
    run_job("extract_xvectors", {**cfg, "xvector": {**cfg["xvector"], "save_path": str(tmp_path / "serial")},
                                 "parallel": {"env": "serial"}}, progress=False)
    serial = kaldiio.load_scp(str(tmp_path / "serial" / "xvector" / "valid" / "xvector.scp"))
    assert sorted(serial) == sorted(scp)
    for key in scp:
        np.testing.assert_allclose(scp[key], serial[key], rtol=1e-5, atol=1e-6)


def test_extract_xvectors_command_line(ecapa_dir, demo_corpus, tmp_path, session_api_url):
    env = cli_env(tmp_path / "home", HF_HUB_OFFLINE="1", api_url=session_api_url)
    proc = subprocess.run([sys.executable, "flows/extract_xvectors.py", f"xvector.pretrained_model={ecapa_dir}",
                           f"xvector.manifest_paths.valid={demo_corpus['valid']}", "xvector.splits=[valid]",
                           f"xvector.save_path={tmp_path / 'out'}", "shard_size=6", "parallel.env=serial"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "valid: 12 utterances" in proc.stdout
    assert (tmp_path / "out/xvector/valid/spk_xvector.scp").is_file()


@pytest.mark.s3
def test_xvector_flow_to_s3_equals_the_local_outputs(prefect_harness, ecapa_dir, demo_corpus, s3_output, tmp_path):
    url, options = s3_output
    base = {"pretrained_model": str(ecapa_dir), "manifest_paths": demo_corpus, "splits": ["valid"], "batch_size": 4}
    local = run_job("extract_xvectors", {"xvector": base | {"save_path": str(tmp_path / "xv")}, "shard_size": 4,
                                         "parallel": {"env": "serial"}}, progress=False)["valid"]
    remote = run_job("extract_xvectors", {"xvector": base | {"save_path": url}, "storage_options": options,
                                          "shard_size": 4, "parallel": {"env": "serial"}}, progress=False)["valid"]
    assert remote["utterances"] == local["utterances"] == 12 and remote["speakers"] == 3
    assert remote["shards_computed"] == remote["shards"] > 1

    fs = s3fs.S3FileSystem(**options)
    root = f"{url[len('s3://'):]}/xvector/valid"
    local_dir = tmp_path / "xv" / "xvector" / "valid"
    for name in ("xvector", "spk_xvector"):
        # the scp on S3 points into the ark on S3 (s3:// URL with the offset), never at staging
        lines = fs.cat(f"{root}/{name}.scp").decode().splitlines()
        assert lines and all(line.split(" ", 1)[1].startswith(f"{url}/xvector/valid/{name}.ark:") for line in lines)
        fetched = tmp_path / f"{name}.ark"
        fs.get(f"{root}/{name}.ark", str(fetched))
        got = dict(kaldiio.load_ark(str(fetched)))
        want = kaldiio.load_scp(str(local_dir / f"{name}.scp"))
        assert got.keys() == set(want.keys())
        for key, vec in want.items():
            assert_same_floats(got[key], vec)  # two runs
    for key in kaldiio.load_scp(str(local_dir / "xvector.scp")):
        with fs.open(f"{root}/{key}.pt", "rb") as f:
            assert_same_floats(torch.load(f, weights_only=True), torch.load(local_dir / f"{key}.pt", weights_only=True))
    assert not fs.exists(f"{url[len('s3://'):]}/.prefect-results")
    for path in fs.find(url[len("s3://"):]):
        assert options["secret"].encode() not in fs.cat(path), f"{path} holds the secret"


def _cli_env(tmp_path: Path, api_url: str) -> dict[str, str]:
    """A CLI run's environment with no ``HF_*`` variable, against the session's server ``api_url``."""
    return cli_env(tmp_path / "home", drop=("HF_",), api_url=api_url)


def _cache_as_hub_model(model_dir: Path, cache: Path, repo_id: str) -> None:
    """Lay ``model_dir``'s files out as huggingface_hub's cache does after a download."""
    import shutil

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    revision = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(model_dir, repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)


def test_cached_hub_id_runs_with_no_network_attempt(ecapa_dir, demo_corpus, tmp_path, session_api_url):
    """HF_HUB_OFFLINE unset (the job itself must not go online): every process of the run is
    audited for TCP connects and name lookups of non-loopback hosts, and there are none."""
    cache = tmp_path / "hf-cache"
    _cache_as_hub_model(ecapa_dir, cache, "espnet3-tests/ecapa-random")
    audit = tmp_path / "net.log"
    env = _cli_env(tmp_path, session_api_url)
    env.update(HF_HUB_CACHE=str(cache), NETAUDIT_LOG=str(audit),
               PYTHONPATH=f"{ROOT / 'tests' / 'support' / 'netaudit'}{os.pathsep}{ROOT}")
    # the audit is really on in processes started this way: a lookup of a non-loopback name is seen
    probe = subprocess.run([sys.executable, "-c", "import socket\ntry: socket.getaddrinfo('huggingface.co', 443)\n"
                            "except OSError: pass"], env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0 and "huggingface.co" in audit.read_text(), probe.stderr
    audit.unlink()
    proc = subprocess.run([sys.executable, "flows/extract_xvectors.py", "xvector.pretrained_model=espnet3-tests/ecapa-random",
                           f"xvector.manifest_paths.valid={demo_corpus['valid']}", "xvector.splits=[valid]",
                           f"xvector.save_path={tmp_path / 'out'}", "shard_size=6", "parallel.env=local",
                           "parallel.n_workers=1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out/xvector/valid/xvector.scp").is_file()
    assert not audit.exists() or audit.read_text() == "", audit.read_text()


@pytest.mark.parametrize("source, expected", [
    ("{tmp}/no-such-dir", "does not exist"),
    ("espnet3-tests/not-in-any-cache", "never downloads models"),
])
def test_model_source_problems_are_found_before_any_cluster(demo_corpus, tmp_path, source, expected, session_api_url):
    env = _cli_env(tmp_path, session_api_url) | {"HF_HUB_CACHE": str(tmp_path / "empty-cache")}
    proc = subprocess.run([sys.executable, "flows/extract_xvectors.py",
                           f"xvector.pretrained_model={source.format(tmp=tmp_path)}",
                           f"xvector.manifest_paths.valid={demo_corpus['valid']}", f"xvector.save_path={tmp_path / 'o'}",
                           "parallel.env=local"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: xvector.pretrained_model:") and expected in lines[0], lines


def test_xvector_demo_runs_with_no_arguments_and_says_its_model_is_random(tmp_path, session_api_url):
    env = _cli_env(tmp_path, session_api_url) | {"HF_HUB_OFFLINE": "1"}
    out = tmp_path / "exp" / "xvectors"
    args = [sys.executable, "flows/extract_xvectors.py", f"xvector.save_path={out}", "parallel.n_workers=1"]
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RANDOM-WEIGHT ECAPA-TDNN" in proc.stderr and "meaningless" in proc.stderr
    model = tmp_path / "exp" / "demo_data" / "ecapa-random-weights"
    assert (model / "hyperparams.yaml").is_file() and str(model) in proc.stderr
    for split in ("train", "valid", "test"):
        assert len(kaldiio.load_scp(str(out / "xvector" / split / "xvector.scp"))) > 0
    again = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "nothing to compute" in again.stdout, again.stdout + again.stderr[-2000:]


def test_a_newer_cached_revision_of_a_hub_model_changes_the_shard_hashes(ecapa_dir, tmp_path, monkeypatch):
    from espnet3_flows.xvector.job import XVectorConfig, _model_fingerprint

    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    _cache_as_hub_model(ecapa_dir, cache, "espnet3-tests/ecapa-random")
    hub_model = XVectorConfig(pretrained_model="espnet3-tests/ecapa-random")
    before = _model_fingerprint(hub_model)
    repo = cache / "models--espnet3-tests--ecapa-random"
    newer = "fedcba9876543210fedcba9876543210fedcba98"
    (repo / "snapshots" / (repo / "refs" / "main").read_text()).rename(repo / "snapshots" / newer)
    (repo / "refs" / "main").write_text(newer)
    assert _model_fingerprint(hub_model) != before
