"""An ``owner.json`` that names no owner (empty, truncated, not JSON) is replaced by the run's claim
with a warning naming it, as any unreadable record is; an output location that cannot be written is
an error in the config: exit status 2, one ``error:`` line naming the directory."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from espnet3_flows.config import ConfigError, load_config
from espnet3_flows.orchestration.job_run import plan_job
from espnet3_flows.parallel.scheduler import InProcessExecutor, run_planned
from espnet3_flows.split_outputs import OutputsOwnedError, claim_outputs
from espnet3_flows.storage import OutputNotWritableError, Storage, StorageError
from tests.support.servers import cli_env

ROOT = Path(__file__).resolve().parents[2]
DAMAGED = {"empty": b"", "truncated": b'{\n  "config": {"frontend": {"n_mels": 8', "not-utf8": b"\xff\xfe{}",
           "not-a-record": b"[]\n"}


@pytest.mark.parametrize("local", [True, False], ids=["disk", "memory"])
@pytest.mark.parametrize("damage", list(DAMAGED))
def test_an_unreadable_owner_record_is_replaced_with_a_warning_naming_it(tmp_path, caplog, local, damage):
    store = Storage(str(tmp_path / "out") if local else f"memory://owner-{uuid.uuid4().hex}/out")
    store.write_bytes("train/owner.json", DAMAGED[damage])
    with caplog.at_level(logging.WARNING, logger="espnet3_flows.split_outputs"):
        claim_outputs(store, "train", "collect_stats", {"frontend": {"n_mels": 80}})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"{store.uri('train', 'owner.json')} is unreadable" in warnings[0], warnings
    assert "replaced" in warnings[0]
    assert store.read_json("train/owner.json") == {"job": "collect_stats", "config": {"frontend": {"n_mels": 80}}}
    caplog.clear()
    claim_outputs(store, "train", "collect_stats", {"frontend": {"n_mels": 80}})  # the claim holds: no warning
    with pytest.raises(OutputsOwnedError, match="n_mels=80"):
        claim_outputs(store, "train", "collect_stats", {"frontend": {"n_mels": 40}})
    assert not caplog.records


def test_a_run_over_an_emptied_owner_record_completes_exactly(demo_corpus, tmp_path, caplog):
    from espnet3_flows.orchestration.jobs import get_job

    out = tmp_path / "exp"
    cfg = load_config(get_job("collect_stats").config_class,
                      overrides=[f"manifests.train={demo_corpus['valid']}", f"output_dir={out}", "shard_size=8",
                                 "parallel.env=serial"])
    run_planned(plan_job("collect_stats", cfg).runners, InProcessExecutor(), progress=False)
    before = (out / "train" / "feats_shape").read_bytes()
    (out / "train" / "owner.json").write_bytes(b"")  # a disk that filled, a copy cut short
    (out / "train" / "summary.json").unlink()  # (merged again: the claim is checked by every run that writes)
    with caplog.at_level(logging.WARNING):
        run = plan_job("collect_stats", cfg)
        run_planned(run.runners, InProcessExecutor(), progress=False)
    assert any(f"{out}/train/owner.json is unreadable" in r.getMessage() for r in caplog.records)
    assert json.loads((out / "train" / "owner.json").read_text())["job"] == "collect_stats"
    assert (out / "train" / "feats_shape").read_bytes() == before


def test_an_unwritable_output_location_is_a_config_error_naming_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(OutputNotWritableError, match=rf"output location {blocker}/out is not writable") as err:
        Storage(blocker / "out").check_writable()
    assert isinstance(err.value, ConfigError) and isinstance(err.value, StorageError)


_CALLS_MAIN = """
import json, sys
from espnet3_flows.orchestration.entry import main

print(json.dumps({"status": main("collect_stats", sys.argv[1:])}))
"""


@pytest.mark.prefect
def test_the_cli_exits_2_in_one_line_naming_an_unwritable_output_dir(tmp_path, demo_corpus, session_api_url):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    proc = subprocess.run([sys.executable, "-c", _CALLS_MAIN, f"manifests.train={demo_corpus['valid']}",
                           f"output_dir={blocker / 'out'}", "parallel.env=serial"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env=cli_env(tmp_path / "prefect-home", HF_HUB_OFFLINE="1", api_url=session_api_url))
    text = proc.stdout + proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"status": 2}, text
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: output location {blocker}/out is not writable"), text
    assert "Traceback" not in text and not (blocker.parent / "logs").exists()


def test_an_endpoint_nobody_listens_on_is_a_failure_not_a_config_error():
    """A store that cannot be reached may be down for a while: the run fails (exit 1) and a rerun
    works once it is back, whereas a store that answers 'no' is a setting to fix (exit 2)."""
    from tests.support.servers import free_port

    options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}"},
               "config_kwargs": {"connect_timeout": 1, "read_timeout": 1, "retries": {"total_max_attempts": 1}}}
    with pytest.raises(StorageError) as err:
        Storage("s3://bucket/out", options).check_writable()
    assert not isinstance(err.value, ConfigError), err.value
