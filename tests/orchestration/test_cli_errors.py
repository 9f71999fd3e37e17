"""Every input or config error a CLI run meets, before or after the flow starts, is one ``error:``
line naming the place (file:line, key or path) and the cause, in at most 10 lines of output;
``--verbose`` brings back the traceback and the log lines."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.servers import cli_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.prefect, pytest.mark.dask]


def _cli(tmp_path: Path, *args: str, api_url: str | None = None, **settings: str) -> tuple[int, list[str], str]:
    """(exit status, output lines as a terminal shows them, the whole output) of a CLI run: with
    ``api_url``, against that server; else with no API configured (the run's private server);
    ``settings``: more environment variables."""
    env = cli_env(tmp_path / "prefect-home", HF_HUB_OFFLINE="1", api_url=api_url, **settings)
    proc = subprocess.run([sys.executable, "flows/collect_stats.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    # a progress bar redraws with \r on one line; count lines as a terminal shows them
    lines = [line for line in text.replace("\r", "\n").splitlines() if line.strip() and "shard/s]" not in line]
    return proc.returncode, lines, text


def _good_lines(demo_corpus) -> list[str]:
    return Path(demo_corpus["valid"]).read_text().splitlines()


def _assert_one_error_line(lines: list[str], text: str, *expected: str) -> str:
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, text
    assert len(lines) <= 10, f"{len(lines)} lines:\n{text}"
    assert "Traceback" not in text, text
    for part in expected:
        assert part in errors[0], f"{part!r} not in {errors[0]!r}"
    return errors[0]


def _case(name: str, tmp_path: Path, demo_corpus) -> tuple[list[str], tuple[str, ...]]:
    good = _good_lines(demo_corpus)
    manifest = tmp_path / "train.tsv"
    out = tmp_path / "out"
    if name == "missing-audio":  # found by a worker, after the flow started
        missing = tmp_path / "missing.wav"
        manifest.write_text("\n".join([*good, f"utt-missing\t{missing}"]) + "\n")
        return ([f"manifests.train={manifest}", f"output_dir={out}", "parallel.env=local", "parallel.n_workers=1"],
                ("utt-missing", str(missing), f"line {len(good) + 1}", "not found"))
    if name == "bad-line":
        manifest.write_text("\n".join([*good[:3], "only-one-field", *good[3:]]) + "\n")
        return [f"manifests.train={manifest}", f"output_dir={out}"], (str(manifest), ":4", "field")
    if name == "duplicate-id":
        manifest.write_text("\n".join([*good, good[2]]) + "\n")
        return [f"manifests.train={manifest}", f"output_dir={out}"], (str(manifest), "duplicate", good[2].split("\t")[0])
    if name == "missing-manifest":
        return [f"manifests.train={tmp_path / 'nope.tsv'}", f"output_dir={out}"], ("nope.tsv", "not found")
    if name == "output-dir-is-a-file":
        manifest.write_text("\n".join(good) + "\n")
        (tmp_path / "a-file").write_text("x")
        return [f"manifests.train={manifest}", f"output_dir={tmp_path / 'a-file'}"], ("a-file", "not")
    if name == "unparsable-yaml":
        conf = tmp_path / "stats.yaml"
        conf.write_text("manifests:\n  train: [unclosed\n")
        return ["--config", str(conf), f"output_dir={out}"], ("stats.yaml",)
    if name == "jsonl-gz-not-gzip":
        fake = tmp_path / "cuts.jsonl.gz"
        fake.write_text('{"id": "x"}\n')
        return [f"manifests.train={fake}", f"output_dir={out}"], ("cuts.jsonl.gz", "train", "gzip")
    raise AssertionError(name)


CASES = ["missing-audio", "bad-line", "duplicate-id", "missing-manifest", "output-dir-is-a-file",
         "unparsable-yaml", "jsonl-gz-not-gzip"]


@pytest.mark.parametrize("name", CASES)
def test_error_is_one_line(tmp_path, demo_corpus, name, session_api_url):
    args, expected = _case(name, tmp_path, demo_corpus)
    code, lines, text = _cli(tmp_path, *args, api_url=session_api_url)
    assert code != 0, text
    _assert_one_error_line(lines, text, *expected)
    if name == "missing-audio":  # found after the flow started: the traceback is kept beside the outputs
        saved = sorted((tmp_path / "out" / "logs").glob("collect_stats-*.error.txt"))
        assert len(saved) == 1 and str(saved[0]) in text, text
        assert "Traceback" in saved[0].read_text() and "utt-missing" in saved[0].read_text()


@pytest.mark.parametrize("name", ["key-typo", "unparsable-yaml"])
def test_a_config_error_starts_no_server(tmp_path, demo_corpus, name):
    """The config is read before anything starts: with no API configured, a typo in a key or a
    file that is not YAML is one error line, and no private Prefect server was launched for it."""
    args, expected = (["shard_sise=3", f"output_dir={tmp_path / 'out'}"], ("shard_sise", "shard_size")) \
        if name == "key-typo" else _case(name, tmp_path, demo_corpus)
    timeline = tmp_path / "timeline.jsonl"
    code, lines, text = _cli(tmp_path, *args, ESPNET3_FLOWS_TIMELINE=str(timeline))
    assert code == 2, text
    _assert_one_error_line(lines, text, *expected)
    events = [json.loads(line)["event"] for line in timeline.read_text().splitlines()] if timeline.exists() else []
    assert "main" in events and "server_launched" not in events, events


def test_verbose_keeps_the_traceback_and_the_logs(tmp_path, demo_corpus, session_api_url):
    args, expected = _case("missing-audio", tmp_path, demo_corpus)
    # on a cluster (one shard would run in the driver): Dask's log lines are shown too
    code, lines, text = _cli(tmp_path, *args, "--verbose", "parallel.options.inline_shards=0", api_url=session_api_url)
    assert code == 1
    assert "Traceback" in text and "distributed.scheduler" in text and "Finished in state Failed" in text
    assert sum(line.startswith("error:") for line in lines) == 1


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_good_run_is_short_and_says_where_outputs_are(tmp_path, demo_corpus, start_method, session_api_url):
    # the forkserver run with its private server, the spawned one against the session's server
    # (with every patch off, runs on a local cluster are checked by the patches-off pass's
    # test_runner_flow_console, test_collect_stats_flow and, for the CLI, test_api_server_killed)
    api_url = session_api_url if start_method == "spawn" else None
    manifest = tmp_path / "train.tsv"
    manifest.write_text("\n".join(_good_lines(demo_corpus)) + "\n")
    # several shards: a real LocalCluster whose workers print to this terminal too; spawned ones
    # (as with trim_worker_memory, or every patch off) log Dask's start banner before any setup
    args = [f"manifests.train={manifest}", f"output_dir={tmp_path / 'out'}", "parallel.env=local",
            "parallel.n_workers=2", "shard_size=8", f"parallel.options.start_method={start_method}"]
    code, lines, text = _cli(tmp_path, *args, api_url=api_url)
    assert code == 0, text
    computed = re.search(r"shards computed (\d+) / cached 0", text)
    assert computed and int(computed.group(1)) >= 2, text
    assert not [line for line in lines if "distributed." in line or "Finished in state" in line], text
    assert len(lines) <= 10, text
    assert str(tmp_path / "out" / "train" / "summary.json") in text
    code, lines, text = _cli(tmp_path, *args, api_url=api_url)  # all cached: still says where the outputs are
    assert code == 0 and "nothing to compute" in text and str(tmp_path / "out") in text, text



def test_with_a_configured_server_the_run_link_is_printed(tmp_path, demo_corpus, session_api_url):
    manifest = tmp_path / "train.tsv"
    manifest.write_text("\n".join(_good_lines(demo_corpus)) + "\n")
    code, _, text = _cli(tmp_path, f"manifests.train={manifest}", f"output_dir={tmp_path / 'out'}",
                         "parallel.env=local", "parallel.n_workers=1", api_url=session_api_url)
    assert code == 0, text
    links = [line for line in text.splitlines() if "View at " in line]
    assert links and all(session_api_url.removesuffix("/api") in line for line in links), text
    assert "Finished in state" not in text and "distributed." not in text, text


_CALLS_MAIN = """
import json, os, sys
from espnet3_flows.orchestration import entry
from espnet3_flows.orchestration.entry import main

VARS = ("ESPNET3_FLOWS_QUIET", "DASK_LOGGING__DISTRIBUTED")
asked, during = [], []
rule = entry.quiet_workers_of

def rule_and_see(backend, verbose):  # what the run's local workers are told at their start
    told = rule(backend, verbose)
    asked.append(told)
    during.append({k: os.environ.get(k) for k in VARS})
    return told

entry.quiet_workers_of = rule_and_see
before = {k: os.environ.get(k) for k in VARS}
status = main("collect_stats", sys.argv[1:])
after = {k: os.environ.get(k) for k in VARS}
print(json.dumps({"status": status, "asked": asked, "before": before, "during": during, "after": after}))
"""


@pytest.mark.parametrize("own_level", [None, "error"])
def test_main_called_in_process_leaves_the_environment_as_it_was(tmp_path, demo_corpus, own_level, session_api_url):
    """``main()`` from a process that goes on (a notebook, a Prefect worker, a test session): the
    quiet logging it asks of its local workers is what they are told at their start, never this
    process's environment, so what that process starts later (an ``env=ssh`` scheduler, which
    inherits Dask's logging config and is only found by its INFO line) logs as before. A user's own
    Dask logging level is never overridden."""
    manifest = tmp_path / "train.tsv"
    manifest.write_text("\n".join(_good_lines(demo_corpus)) + "\n")
    (tmp_path / "a-file").write_text("x")  # output_dir: found unwritable once the run is planned
    env = cli_env(tmp_path / "prefect-home", drop=("ESPNET3_FLOWS_QUIET", "DASK_LOGGING__DISTRIBUTED"),
                  api_url=session_api_url)
    if own_level:
        env["DASK_LOGGING__DISTRIBUTED"] = own_level
    proc = subprocess.run([sys.executable, "-c", _CALLS_MAIN, f"manifests.train={manifest}",
                           f"output_dir={tmp_path / 'a-file' / 'out'}", "parallel.env=local", "parallel.n_workers=1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert "error:" in proc.stderr and proc.stdout.strip(), proc.stdout + proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["status"] == 2  # an output location that cannot be written: an error in the config
    told = {"ESPNET3_FLOWS_QUIET": "1", **({} if own_level else {"DASK_LOGGING__DISTRIBUTED": "warning"})}
    assert result["asked"] == [told]
    own = {"ESPNET3_FLOWS_QUIET": None, "DASK_LOGGING__DISTRIBUTED": own_level}
    assert result["before"] == own and result["during"] == [own] and result["after"] == own
