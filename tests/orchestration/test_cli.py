"""``python flows/collect_stats.py`` as a user runs it: no server configured, Ctrl-C and SIGKILL."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from espnet3_flows.orchestration.flows import run_job
from tests.support.servers import cli_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.prefect, pytest.mark.dask, pytest.mark.slow]


def _clean_env(tmp_path: Path) -> dict[str, str]:
    return cli_env(tmp_path / "prefect-home")


def _wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.3)
    return alive


def test_main_command_runs_demo_without_server(tmp_path):
    out = tmp_path / "exp" / "collect_stats"
    proc = subprocess.run([sys.executable, "flows/collect_stats.py", f"output_dir={out}", "demo_utterances=40",
                           "shard_size=8", "parallel.n_workers=2"], cwd=ROOT, env=_clean_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "collect_stats finished" in proc.stdout and "train: 32 utterances" in proc.stdout
    assert (out / "train" / "feats_stats.npz").is_file() and (tmp_path / "exp" / "demo_data" / "train.tsv").is_file()
    assert "Error logging to API" not in proc.stderr
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if str(tmp_path) in " ".join(p.info["cmdline"] or []) and p.pid != os.getpid()]
    assert not leftovers, f"processes left behind: {[p.info['cmdline'] for p in leftovers]}"


def test_bad_config_is_an_error_before_work(tmp_path):
    proc = subprocess.run([sys.executable, "flows/collect_stats.py", f"output_dir={tmp_path}/o", "shard_sise=3"],
                          cwd=ROOT, env=_clean_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "shard_sise" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_sigkill_of_flow_process_then_rerun_recomputes_only_unfinished(tmp_path, prefect_harness, demo_corpus):
    out = tmp_path / "out"
    args = [f"manifests.train={demo_corpus['train']}", f"output_dir={out}", "shard_size=4", "batch_size=4",
            "frontend.type=model", "frontend.model._target_=tests.orchestration.slow_model.SlowFramer",
            "parallel.n_workers=2"]
    env = _clean_env(tmp_path)  # no server configured: the run starts its private one
    proc = subprocess.Popen([sys.executable, "flows/collect_stats.py", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    family: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(list(out.glob("train/shards/split.*/done"))) < 3:
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.1)
        family = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert any("uvicorn" in " ".join(psutil.Process(p).cmdline()) for p in family), "no private server seen"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not _wait_gone(family), "Dask workers or servers outlived the killed flow process"
    finally:  # nothing outlives a failed assertion either
        for pid in [proc.pid, *family]:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
    n = len(json.loads((out / "train/shards/manifest.json").read_text())["shards"])
    done_before = {p.parent.name for p in out.glob("train/shards/split.*/done")}
    assert 3 <= len(done_before) < n
    assert not (out / "train" / "summary.json").exists()

    cfg = {"manifests": {"train": demo_corpus["train"]}, "output_dir": str(out), "shard_size": 4, "batch_size": 4,
           "frontend": {"type": "model", "model": {"_target_": "tests.orchestration.slow_model.SlowFramer"}},
           "parallel": {"env": "serial"}}  # the killed run's config, so its finished shards match
    rerun = run_job("collect_stats", cfg, progress=False)["train"]
    assert rerun["shards_cached"] == len(done_before)
    assert rerun["shards_computed"] == n - len(done_before)
    clean = run_job("collect_stats", cfg | {"output_dir": str(tmp_path / "clean")}, progress=False)["train"]
    a, b = np.load(out / "train/feats_stats.npz"), np.load(tmp_path / "clean/train/feats_stats.npz")
    assert int(a["count"]) == int(b["count"]) == clean["frames"]
    np.testing.assert_allclose(a["sum"], b["sum"], rtol=1e-12)
    np.testing.assert_allclose(a["sum_square"], b["sum_square"], rtol=1e-12)
    assert (out / "train/feats_shape").read_bytes() == (tmp_path / "clean/train/feats_shape").read_bytes()


def test_help_lists_every_key(tmp_path):
    proc = subprocess.run([sys.executable, "flows/extract_xvectors.py", "--help"], cwd=ROOT,
                          env=_clean_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    for key in ("xvector.pretrained_model=", "xvector.spk_embed_tag=\"\"", "shard_size=128",
                "parallel.env=\"local\"", "on_error=\"fail\""):
        assert key in proc.stdout
    _assert_every_key_described(proc.stdout)


def _assert_every_key_described(text: str) -> None:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("keys (default)"))
    keys = [i for i in range(start + 1, len(lines)) if lines[i].startswith("  ") and not lines[i].startswith("   ")]
    assert len(keys) > 25
    for i in keys:
        assert i + 1 < len(lines) and lines[i + 1].startswith("      ") and lines[i + 1].strip(), \
            f"{lines[i].strip()} has no description"


def test_collect_stats_help_describes_every_key(tmp_path):
    from espnet3_flows.orchestration.entry import usage

    text = usage("collect_stats")
    _assert_every_key_described(text)
    assert "frontend.channel=null\n      Channel of multi-channel audio" in text


def test_module_and_console_scripts_and_print_config_round_trip(tmp_path, demo_corpus):
    env = _clean_env(tmp_path)
    args = [f"manifests.valid={demo_corpus['valid']}", f"output_dir={tmp_path / 'out'}", "shard_size=7",
            "storage_options.secret=do-not-print"]
    printed = subprocess.run([sys.executable, "-m", "espnet3_flows", "collect_stats", "--print-config", *args],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    import yaml

    conf = yaml.safe_load(printed.stdout)
    assert conf["shard_size"] == 7 and conf["manifests"] == {"valid": demo_corpus["valid"]}
    assert "do-not-print" not in printed.stdout and conf["storage_options"]["secret"] == "***"
    conf["storage_options"] = {}  # redacted credentials are not credentials
    (tmp_path / "resolved.yaml").write_text(yaml.safe_dump(conf))
    script = Path(sys.executable).with_name("espnet3-collect-stats")
    assert script.is_file(), "console script missing: reinstall (make install)"
    planned = subprocess.run([str(script), "--config", str(tmp_path / "resolved.yaml"), "--dry-run"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert planned.returncode == 0 and "(dry run)" in planned.stdout, planned.stdout + planned.stderr
    helped = subprocess.run([str(Path(sys.executable).with_name("espnet3-extract-xvectors")), "--help"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "xvector.pretrained_model=" in helped.stdout


def test_print_config_and_dry_run_mask_credentials_of_every_section(tmp_path, demo_corpus):
    """An ssh cluster's login and its workers' environment, given in a --config file and as an
    override, are shown masked: --print-config's YAML and --dry-run's cluster line."""
    import yaml

    secret = "sEcReT-9a4f-do-not-print"
    conf = {"manifests": {"valid": demo_corpus["valid"]}, "output_dir": str(tmp_path / "out"),
            "storage_options": {"secret": secret},
            "parallel": {"env": "ssh", "options": {
                "hosts": ["127.0.0.1", "localhost"],
                "connect_options": {"username": "u", "password": secret, "passphrase": secret,
                                    "client_keys": [f"/keys/{secret}"]},
                "worker_options": {"env": {"AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1"}}}}}
    (tmp_path / "ssh.yaml").write_text(yaml.safe_dump(conf))
    args = ["--config", str(tmp_path / "ssh.yaml"), f"parallel.options.worker_options.env.HF_TOKEN={secret}"]
    env = _clean_env(tmp_path)
    printed = subprocess.run([sys.executable, "flows/collect_stats.py", "--print-config", *args], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert secret not in printed.stdout + printed.stderr
    shown = yaml.safe_load(printed.stdout)
    options = shown["parallel"]["options"]
    assert options["connect_options"] == {"username": "u", "password": "***", "passphrase": "***",
                                          "client_keys": "***"}
    assert options["worker_options"]["env"] == {"AWS_SECRET_ACCESS_KEY": "***", "AWS_DEFAULT_REGION": "us-east-1",
                                                "HF_TOKEN": "***"}
    assert shown["storage_options"] == {"secret": "***"} and options["hosts"] == ["127.0.0.1", "localhost"]
    dry = subprocess.run([sys.executable, "flows/collect_stats.py", "--dry-run", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0 and "  cluster: ssh: distributed.SSHCluster(" in dry.stdout, dry.stdout + dry.stderr
    assert secret not in dry.stdout + dry.stderr and '"password": "***"' in dry.stdout


@pytest.mark.parametrize("job", ["collect_stats", "extract_xvectors"])
def test_a_dry_run_of_the_demo_writes_nothing(tmp_path, job):
    """No input named: a run would generate the demo (a 25 MB corpus, a random model); a dry run
    says so and writes nothing, anywhere (run from an empty directory, as a newcomer would)."""
    here = tmp_path / "empty"
    here.mkdir()
    env = {**_clean_env(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "espnet3_flows", job, "--dry-run"], cwd=here, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{job} (dry run): no input is named, so a run generates the demo data in {here / 'exp' / 'demo_data'}" \
        in proc.stdout and "Nothing was written." in proc.stdout
    assert list(here.iterdir()) == []


def test_help_is_whole_plain_sentences_with_the_jobs_keys_first():
    from espnet3_flows.orchestration.entry import first_sentence, usage

    text = usage("collect_stats")
    assert ":class:" not in text and ":mod:" not in text and "``" not in text and "…" not in text
    assert "parallel.options={}\n      Keyword arguments for the cluster class (e.g." in text  # not cut at "e.g."
    assert text.index("\n  frontend.type=") < text.index("\n  shard_size=") < text.index("\n  parallel.env=")
    assert "manifests.train=data/train.tsv" in text
    assert max(len(line) for line in text.splitlines() if line.startswith("      ")) <= 100
    assert first_sentence("Uses :class:`~a.b.Thing` and :mod:`a.b`, e.g. ``x``. Then more.") == \
        "Uses `Thing` and `a.b`, e.g. `x`."


def test_a_missing_manifest_is_the_users_error_and_leaves_nothing_behind(tmp_path):
    env = {**_clean_env(tmp_path), "PYTHONPATH": str(ROOT)}
    here = tmp_path / "work"
    here.mkdir()
    proc = subprocess.run([sys.executable, "-m", "espnet3_flows", "collect_stats",
                           f"manifests.train={tmp_path / 'nowhere' / 'train.tsv'}", "output_dir=exp/o"],
                          cwd=here, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert lines == [f"error: split 'train': manifest not found: {tmp_path / 'nowhere' / 'train.tsv'}"], lines
    assert list(here.iterdir()) == []
