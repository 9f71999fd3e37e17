"""A command line's run planned before its heavy imports (:mod:`espnet3_flows.orchestration.early_start`):
the plan handed to ``main``, the forkserver started only for runs on local forked workers with the
job's and frontend's modules, log records and errors handed over."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from espnet3_flows.orchestration.early_start import start_early
from espnet3_flows.parallel.forkserver import preloaded_modules, stop_forkserver


@pytest.fixture
def no_forkserver(monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # configured: no early server launched
    stop_forkserver()
    yield
    stop_forkserver()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from espnet3_flows.inputs.demo import make_demo_corpus

    root = tmp_path_factory.mktemp("early")
    return make_demo_corpus(root, n_utts=6, n_speakers=2, min_seconds=0.3, max_seconds=0.6,
                            splits={"train": 1.0})["train"]


@pytest.mark.patch
def test_a_run_on_local_workers_is_planned_and_its_forkserver_started(no_forkserver, corpus, tmp_path):
    argv = [f"manifests.train={corpus}", f"output_dir={tmp_path}", "shard_size=2", "parallel.n_workers=1",
            "frontend.type=espnet2", "frontend.name=default"]
    early = start_early("collect_stats", argv)
    assert early is not None and early.error is None and early.planned.pending_shards >= 2
    preloaded = preloaded_modules()
    for module in ("prefect.task_engine", "espnet3_flows.stats.job", "espnet3_flows.frontends.espnet2_default"):
        assert module in preloaded
    assert "espnet2.asr.frontend.default" not in preloaded and "librosa.filters" not in preloaded  # the fast path's
    assert early.server is None  # an API is configured: no private server launched


def test_runs_in_the_driver_start_no_forkserver(no_forkserver, corpus, tmp_path):
    four = tmp_path / "four.tsv"  # a split of at most MIN_BUSY_SHARD items is one shard on any number of workers
    four.write_text("".join([line for line in corpus.read_text().splitlines(keepends=True)
                             if not line.startswith("#")][:4]))
    one_shard = start_early("collect_stats", [f"manifests.train={four}", f"output_dir={tmp_path / 'a'}"])
    assert one_shard is not None and one_shard.planned.pending_shards == 1
    serial = start_early("collect_stats", [f"manifests.train={corpus}", f"output_dir={tmp_path / 'b'}",
                                           "shard_size=2", "parallel.env=serial"])
    assert serial is not None and serial.planned.pending_shards >= 2
    assert preloaded_modules() == ()
    assert start_early("collect_stats", ["--dry-run", f"manifests.train={corpus}"]) is None


def test_a_bad_config_is_left_to_main_and_a_planning_error_is_kept(no_forkserver, tmp_path):
    assert start_early("collect_stats", ["shard_sise=3"]) is None  # main() reads it again and reports it
    early = start_early("collect_stats", [f"manifests.train={tmp_path / 'missing.tsv'}", f"output_dir={tmp_path}"])
    assert early is not None and early.planned is None and early.error is not None
    assert "missing.tsv" in str(early.error)


def test_log_records_of_the_early_plan_are_replayed_where_enabled(no_forkserver, corpus, tmp_path, monkeypatch, caplog):
    """Records logged while planning (a store's warning, a debug line) wait for the console to be set up."""
    from espnet3_flows.orchestration import job_run

    real = job_run.plan_job

    def plan_and_log(job, cfg, publish=True):
        logging.getLogger("s3fs").warning("a store's warning")
        logging.getLogger("espnet3_flows.inputs").debug("a debug line")
        return real(job, cfg, publish)

    monkeypatch.setattr(job_run, "plan_job", plan_and_log)
    early = start_early("collect_stats", [f"manifests.train={corpus}", f"output_dir={tmp_path / 'out'}"])
    assert early is not None and early.error is None
    assert [r.getMessage() for r in early.records] == ["a store's warning", "a debug line"]
    caplog.clear()  # (pytest's own handler saw them live)
    with caplog.at_level(logging.INFO):
        early.replay_logs()
    assert [r.getMessage() for r in caplog.records] == ["a store's warning"]  # debug: not enabled now
    assert early.records == []  # once


def test_what_forked_workers_preload_for_a_runner_and_a_frontend(tmp_path):
    from espnet3_flows.frontends.frontend import FrontendConfig, frontend_modules
    from espnet3_flows.orchestration.job_run import QUIET_WORKERS, runner_modules
    from tests.parallel.espnet3_runners import ListProvider, RecordsRunner

    runner = RecordsRunner(ListProvider({"n": 4}), shard_size=2)
    # the console quieting comes last: after the driver's script, whose imports set the console up
    assert runner_modules(runner) == ("tests.parallel.espnet3_runners", QUIET_WORKERS)
    runner.worker_modules = ("colorsys",)  # a runner's own list (e.g. its model's package)
    assert runner_modules(runner) == ("tests.parallel.espnet3_runners", "colorsys", QUIET_WORKERS)
    assert frontend_modules(FrontendConfig()) == ("lhotse",)  # fbank
    assert frontend_modules(FrontendConfig(type="none")) == ()
    assert frontend_modules(FrontendConfig(type="espnet2")) == ("torch", "espnet3_flows.frontends.espnet2_default")
    assert frontend_modules(FrontendConfig(type="espnet2", espnet2_class=True)) == ("espnet2.asr.frontend.default",
                                                                                     "librosa.filters")
    assert frontend_modules(FrontendConfig(type="espnet2", name="s3prl")) == ("espnet2.asr.frontend.s3prl",)
    (tmp_path / "config.yaml").write_text("frontend: s3prl\n")
    from_model = FrontendConfig(type="espnet2", espnet_config=str(tmp_path / "config.yaml"))  # the model's config names it
    assert frontend_modules(from_model) == ("espnet2.asr.frontend.s3prl",)
    model = {"_target_": "tests.parallel.espnet3_runners.FbankModel"}
    assert frontend_modules(FrontendConfig(type="model", model=model)) == ("tests.parallel.espnet3_runners",)


@pytest.mark.parametrize("job", ["collect_stats", "extract_features"])
def test_a_command_line_reads_its_config_before_the_libraries_of_its_run(job, tmp_path):
    """The config is read before the private server is launched: that read imports none of
    the run's libraries (numpy, fsspec, torch, Prefect, Dask), so the server starts as early as it can."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from espnet3_flows.config import split_cli_args\n"
            "from espnet3_flows.orchestration.jobs import resolve_config\n"
            f"path, overrides = split_cli_args(['manifests.train={tmp_path / 'train.tsv'}', 'output_dir={tmp_path}'])\n"
            f"cfg = resolve_config({job!r}, path, {{}}, overrides)\n"
            "print(sorted(m for m in ('numpy', 'fsspec', 'torch', 'prefect', 'distributed') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
