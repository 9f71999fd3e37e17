"""A user's script that starts workers or a run when it is imported (no ``if __name__ ==
"__main__":``): Dask's local workers, and the forkserver they fork from, import it, so the run
ends at once in one ``error:`` line naming the fix, not in ~300 lines ending in ``RuntimeError:
Nanny failed to start.`` (issue 46); the same script with the guard runs, and so does an unguarded
one whose run stays in its own process. Real processes, run as a user runs them: ``python
script.py`` in a directory outside this checkout, a runner module beside the script."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from espnet3_flows.parallel.main_guard import importing_main, refuse_while_importing_main
from tests.support.servers import cli_env
from tests.support.user_scripts import USER_RUNNERS

RUNNERS = USER_RUNNERS

HEADER = '''
from espnet3_flows.parallel import get_client, parallel_map, set_parallel
from my_runners import Double, Numbers


def square(x):
    return x * x
'''

#: What each script runs (the README's forms of starting Dask workers), and what it prints
RUNS = {
    "set_parallel": ('set_parallel({"env": "local", "n_workers": 2})\n'
                     'runner = Double(Numbers({"n": 40}), output_dir="exp/double", shard_size=4)\n'
                     'print(sum(runner(range(40))))', "a run", "1560"),
    "set_parallel_prefect_logging": ("import prefect  # Prefect's console logging shows Dask's INFO lines\n"
                                     'set_parallel({"env": "local", "n_workers": 2})\n'
                                     'runner = Double(Numbers({"n": 40}), output_dir="exp/double", shard_size=4)\n'
                                     'print(sum(runner(range(40))))', "a run", "1560"),
    "runner_run": ('runner = Double(Numbers({"n": 40}), output_dir="exp/double", shard_size=4)\n'
                   'print(sum(runner.run(range(40), parallel={"env": "local", "n_workers": 2}).merged))',
                   "a run", "1560"),
    "spawned_workers": ('set_parallel({"env": "local", "n_workers": 2, "options": {"start_method": "spawn"}})\n'
                        'runner = Double(Numbers({"n": 40}), output_dir="exp/double", shard_size=4)\n'
                        'print(sum(runner(range(40))))', "a run", "1560"),
    "parallel_map": ('set_parallel({"env": "local", "n_workers": 2})\n'
                     'print(sum(parallel_map(square, range(10))))', "a Dask cluster", "285"),
    "get_client": ('set_parallel({"env": "local", "n_workers": 2})\n'
                   'with get_client() as client:\n'
                   '    print(sum(parallel_map(square, range(10), client=client)))', "a Dask cluster", "285"),
    "runner_flow": ('runner = Double(Numbers({"n": 40}), output_dir="exp/double", shard_size=4)\n'
                    'print(sum(runner_flow(runner, range(40), parallel={"env": "local", "n_workers": 2})))',
                    "a flow", "1560"),
    "in_process": ('runner = Double(Numbers({"n": 40}), output_dir="exp/double", shard_size=4)\n'
                   'print(sum(runner(range(40))))', "", "1560"),
}


def _script(tmp_path: Path, run: str, guarded: bool) -> str:
    """Write the runner module and ``<run>.py`` (its run under the guard or not); the script's name."""
    code, _, _ = RUNS[run]
    body = f'if __name__ == "__main__":\n{textwrap.indent(code, "    ")}\n' if guarded else f"{code}\n"
    (tmp_path / "my_runners.py").write_text(RUNNERS)
    name = f"{run}{'_guarded' if guarded else ''}.py"
    flow = "from espnet3_flows.orchestration import runner_flow\n" if "runner_flow" in code else ""
    (tmp_path / name).write_text(flow + HEADER + "\n\n" + body)
    return name


def _run(tmp_path: Path, script: str, api_url: str | None = None) -> tuple[int, list[str], str, float]:
    """Run ``python script`` in ``tmp_path`` as a user does: exit status, every line it printed,
    its stdout, wall seconds; a flow's API is its private server, or ``api_url``."""
    env = cli_env(tmp_path / "prefect-home", drop=("ESPNET3_FLOWS_",), api_url=api_url)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    return proc.returncode, proc.stderr.splitlines() + proc.stdout.splitlines(), proc.stdout, time.monotonic() - t0


def _error_line(script: str, what: str) -> str:
    return (f"error: {script} starts {what} when it is imported, and each Dask worker imports it: "
            'put that code under if __name__ == "__main__":')


@pytest.mark.dask
@pytest.mark.parametrize("run", ["set_parallel", "set_parallel_prefect_logging", "runner_run", "spawned_workers",
                                 "parallel_map", "get_client"])
def test_an_unguarded_script_that_starts_workers_ends_in_one_line(tmp_path, run):
    script = _script(tmp_path, run, guarded=False)
    status, lines, _, seconds = _run(tmp_path, script)
    assert status == 1, "\n".join(lines)
    assert lines == [_error_line(script, RUNS[run][1])], "\n".join(lines)
    assert seconds < 90  # 2-3 s on a quiet machine: nothing waits for a worker that cannot come


@pytest.mark.dask
@pytest.mark.parametrize("run", ["set_parallel", "get_client"])
def test_the_same_script_with_the_guard_runs(tmp_path, run):
    status, lines, out, _ = _run(tmp_path, _script(tmp_path, run, guarded=True))
    assert status == 0, "\n".join(lines)
    assert out.split() == [RUNS[run][2]]


@pytest.mark.prefect
@pytest.mark.dask
def test_an_unguarded_runner_flow_ends_in_one_line_before_its_flow_and_the_guarded_one_runs(tmp_path,
                                                                                            session_api_url):
    script = _script(tmp_path, "runner_flow", guarded=False)
    status, lines, _, seconds = _run(tmp_path, script, session_api_url)
    assert status == 1, "\n".join(lines)
    assert lines == [_error_line(script, "a flow")], "\n".join(lines)  # no flow run, no Prefect log
    assert seconds < 150  # the line, not a wait for workers that cannot come

    status, lines, out, _ = _run(tmp_path, _script(tmp_path, "runner_flow", guarded=True), session_api_url)
    assert status == 0, "\n".join(lines)
    assert out.split() == ["1560"]


def test_an_unguarded_script_whose_run_stays_in_its_process_runs(tmp_path):
    status, lines, out, _ = _run(tmp_path, _script(tmp_path, "in_process", guarded=False))
    assert status == 0, "\n".join(lines)
    assert out.split() == ["1560"]  # nothing forked: nothing imports the script again


def test_outside_an_import_of_the_main_module_nothing_is_refused():
    assert not importing_main()
    refuse_while_importing_main("a run")  # a driver (or a test) calling it: no error
