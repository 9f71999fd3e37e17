"""``runner_flow`` from a user's script, as the command line behaves: a quiet console (no Dask or
Prefect INFO chatter, no link to a private server that is gone when the run ends, no exit
warnings), ``verbose=True`` keeping everything, and a rerun with nothing due starting no server,
cluster or flow."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.servers import cli_env
from tests.support.user_scripts import USER_RUNNERS

pytestmark = [pytest.mark.prefect, pytest.mark.dask]

RUNNERS = USER_RUNNERS

SCRIPT = '''
import sys

from espnet3_flows.orchestration import runner_flow
from my_runners import Double, Numbers

if __name__ == "__main__":
    runner = Double(Numbers({"n": 16}), output_dir="exp/double", shard_size=4)
    out = runner_flow(runner, range(16), parallel={"env": "local", "n_workers": 2}, verbose="-v" in sys.argv)
    assert out == [2 * i for i in range(16)], out
    print("ok", len(runner.plan(range(16), workers=2).shards))
'''


def _run(tmp_path: Path, *args: str, api_url: str | None = None) -> tuple[list[str], list[str]]:
    """The script's output lines (its own ``ok`` line last) and the driver's timeline events: with no
    API configured (the run's private server), else against ``api_url``."""
    timeline = tmp_path / f"timeline-{len(list(tmp_path.glob('timeline-*')))}.jsonl"
    env = cli_env(tmp_path / "prefect-home", api_url=api_url, ESPNET3_FLOWS_TIMELINE=str(timeline))
    proc = subprocess.run([sys.executable, "run_double.py", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = proc.stderr.splitlines() + proc.stdout.splitlines()
    assert proc.returncode == 0, "\n".join(lines)
    events = [json.loads(line)["event"] for line in timeline.read_text().splitlines()] if timeline.exists() else []
    return lines, events


@pytest.mark.unpatched
def test_a_run_on_two_workers_is_a_few_lines_and_a_rerun_starts_nothing(tmp_path):
    (tmp_path / "my_runners.py").write_text(textwrap.dedent(RUNNERS))
    (tmp_path / "run_double.py").write_text(textwrap.dedent(SCRIPT))

    lines, events = _run(tmp_path)
    shards = int(lines[-1].split()[1])
    assert lines[-1] == f"ok {shards}" and shards >= 2  # a real 2-worker cluster computed them
    assert {"server_ready", "flow_started", "workers_ready"} <= set(events), events
    assert len(lines) <= 10, "\n".join(lines)
    text = "\n".join(lines)
    for noise in ("distributed.", "View at", "EventsWorker", "Traceback", "Finished in state"):
        assert noise not in text, text

    lines, events = _run(tmp_path)
    assert lines == [f"ok {shards}"]  # nothing due: merged here, nothing printed
    assert not {"server_ready", "flow_started", "workers_ready"} & set(events), events

    lines, _ = _run(tmp_path, "-v")  # verbose: the console untouched (a rerun: no cluster to talk about)
    assert lines[-1] == f"ok {shards}"


def test_verbose_keeps_dask_and_prefect_lines(tmp_path, session_api_url):
    (tmp_path / "my_runners.py").write_text(textwrap.dedent(RUNNERS))
    (tmp_path / "run_double.py").write_text(textwrap.dedent(SCRIPT))
    lines, _ = _run(tmp_path, "-v", api_url=session_api_url)
    text = "\n".join(lines)
    assert "distributed." in text and "Finished in state Completed" in text, text


USER_FLOW = '''
import sys

from prefect import flow

from espnet3_flows.orchestration import runner_flow
from my_runners import Double, Numbers


@flow(name="doubles")
def doubles(verbose: bool = False) -> list:
    runner = Double(Numbers({"n": 16}), output_dir="exp/verbose" if verbose else "exp/double", shard_size=4)
    return runner_flow(runner, range(16), parallel={"env": "local", "n_workers": 2}, verbose=verbose)


if __name__ == "__main__":
    assert doubles("-v" in sys.argv) == [2 * i for i in range(16)]
    print("ok")
'''


def test_inside_a_users_flow_the_console_is_theirs_without_our_clusters_chatter(tmp_path, session_api_url):
    """The walkthrough's case: a flow of the user's around ``runner_flow`` printed ~90 lines of
    Dask INFO on success; the cluster's chatter goes, the user's and Prefect's flow lines stay."""
    (tmp_path / "my_runners.py").write_text(textwrap.dedent(RUNNERS))
    (tmp_path / "my_flow.py").write_text(textwrap.dedent(USER_FLOW))

    def run(*args: str) -> list[str]:
        env = cli_env(tmp_path / "prefect-home", api_url=session_api_url)
        proc = subprocess.run([sys.executable, "my_flow.py", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        lines = proc.stderr.splitlines() + proc.stdout.splitlines()
        assert proc.returncode == 0, "\n".join(lines)
        return lines

    lines = run()
    text = "\n".join(lines)
    assert lines[-1] == "ok" and len(lines) <= 15, text
    assert "distributed." not in text and "Creating a new Dask cluster" not in text, text
    assert "Beginning flow run" in text and "Beginning subflow run" in text, text  # Prefect's own lines stay
    verbose = "\n".join(run("-v"))  # its own output: a cluster starts, and says so
    assert "distributed." in verbose and "Beginning subflow run" in verbose, verbose
