"""A split directory belongs to one job and one output-changing config (``owner.json``): another
job, or the same job configured to write other outputs, is refused with one line, also when both
start at once; a config change that does not change outputs (``on_error``, ``shard_size``) is not."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
from pathlib import Path

import pytest

from espnet3_flows.config import load_config
from espnet3_flows.orchestration.job_run import plan_job
from espnet3_flows.parallel.scheduler import InProcessExecutor, run_planned
from espnet3_flows.split_outputs import OutputsOwnedError
from tests.support.servers import cli_env

ROOT = Path(__file__).resolve().parents[2]


def _run(job: str, manifest: str, out: Path, *overrides: str) -> None:
    from espnet3_flows.orchestration.jobs import get_job

    cfg = load_config(get_job(job).config_class, overrides=[f"manifests.train={manifest}", f"output_dir={out}",
                                                            "shard_size=8", "parallel.env=serial", *overrides])
    run = plan_job(job, cfg)
    if run.unchanged_summaries is None:
        run_planned(run.runners, InProcessExecutor(), progress=False)


def _cli(job: str, tmp_path: Path, *args: str, api_url: str) -> subprocess.CompletedProcess:
    env = cli_env(tmp_path / "prefect-home", HF_HUB_OFFLINE="1", api_url=api_url)
    return subprocess.run([sys.executable, "-m", "espnet3_flows", job, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)


def test_another_job_in_the_same_directory_is_refused_in_one_line(demo_corpus, tmp_path, session_api_url):
    out = tmp_path / "exp"
    _run("collect_stats", demo_corpus["valid"], out)
    before = {p: p.read_bytes() for p in (out / "train").iterdir() if p.is_file()}
    proc = _cli("extract_features", tmp_path, f"manifests.train={demo_corpus['valid']}", f"output_dir={out}",
                "frontend.num_mel_bins=40", "parallel.env=serial", api_url=session_api_url)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert f"{out}/train holds the outputs of collect_stats" in lines[0]
    assert "extract_features" in lines[0] and f"remove {out}/train/owner.json" in lines[0]
    assert {p: p.read_bytes() for p in (out / "train").iterdir() if p.is_file()} == before


def test_the_same_job_with_other_outputs_is_refused_naming_the_key(demo_corpus, tmp_path):
    out = tmp_path / "exp"
    _run("collect_stats", demo_corpus["valid"], out)
    with pytest.raises(OutputsOwnedError, match=r"frontend\.num_mel_bins=80 \(this run: 40\)"):
        _run("collect_stats", demo_corpus["valid"], out, "frontend.num_mel_bins=40")
    # neither the error policy nor the shard size changes what a split's outputs are
    _run("collect_stats", demo_corpus["valid"], out, "on_error=skip", "shard_size=5")
    owner = json.loads((out / "train" / "owner.json").read_text())
    assert owner["job"] == "collect_stats" and owner["config"]["frontend"]["num_mel_bins"] == 80
    # the documented way out: remove the record, and the new config's outputs replace the old
    (out / "train" / "owner.json").unlink()
    _run("collect_stats", demo_corpus["valid"], out, "frontend.num_mel_bins=40")
    assert (out / "train" / "feats_shape").read_text().split("\n")[0].endswith(",40")


def test_a_config_mismatch_names_every_split_at_once_and_claims_none(demo_corpus, tmp_path):
    """The issue's case: a nightly run without the CLI's frontend.sampling_rate=8000 was refused
    one split at a time; now in one line naming both, before anything is planned or claimed."""
    from espnet3_flows.orchestration.jobs import get_job

    out = tmp_path / "exp"

    def cfg(*overrides: str):
        return load_config(get_job("collect_stats").config_class, overrides=[
            f"manifests.train={demo_corpus['train']}", f"manifests.valid={demo_corpus['valid']}",
            f"manifests.test={demo_corpus['valid']}", f"output_dir={out}", "parallel.env=serial", *overrides])

    run = plan_job("collect_stats", cfg("frontend.sampling_rate=8000"))
    run_planned(run.runners, InProcessExecutor(), progress=False)
    (out / "test" / "owner.json").unlink()  # one split of three with no owner record: not named
    listing = sorted(str(p) for p in out.rglob("*"))
    with pytest.raises(OutputsOwnedError) as info:
        plan_job("collect_stats", cfg())
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{out}/train, {out}/valid hold collect_stats outputs made with "
                              "frontend.sampling_rate=8000 (this run: 16000); this run (collect_stats) would mix"), message
    assert f"remove {out}/train/owner.json, {out}/valid/owner.json to replace them" in message
    assert sorted(str(p) for p in out.rglob("*")) == listing  # test/owner.json not claimed either


def _start(job: str, manifest: str, out: str, barrier, results, *overrides: str) -> None:
    barrier.wait()
    try:
        _run(job, manifest, Path(out), *overrides)
        results.put((job, "ok"))
    except OutputsOwnedError as exc:
        results.put((job, f"refused: {exc}"))


def test_two_jobs_started_together_one_is_refused(demo_corpus, tmp_path):
    out = str(tmp_path / "exp")
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_start, args=("collect_stats", demo_corpus["valid"], out, barrier, results)),
             ctx.Process(target=_start, args=("extract_features", demo_corpus["valid"], out, barrier, results,
                                              "frontend.num_mel_bins=40"))]
    try:
        for p in procs:
            p.start()
        got = dict(results.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert sorted(v.split(":")[0] for v in got.values()) == ["ok", "refused"], got
    winner = next(job for job, v in got.items() if v == "ok")
    assert json.loads(Path(out, "train", "owner.json").read_text())["job"] == winner
    dims = {line.rsplit(",", 1)[1] for line in Path(out, "train", "feats_shape").read_text().splitlines()}
    assert dims == {"80" if winner == "collect_stats" else "40"}
