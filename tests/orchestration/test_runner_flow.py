"""``runner_flow``: a runner written against ESPnet3's contract, unchanged, as a Prefect flow — one task
per pending shard on a DaskTaskRunner, none on a rerun, a subflow inside a user's flow, a worker
killed mid-flow, S3 output."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from prefect import flow

from espnet3_flows.orchestration import runner_flow
from espnet3_flows.parallel import ShardFailure, set_parallel
from espnet3_flows.storage import Storage
from tests.parallel.espnet3_runners import FailsOn13Runner, HookLogRunner, ListProvider, RecordsRunner
from tests.parallel.jobs_for_tests import ArrayProvider, ScaleSumRunner
from tests.support.prefect_readback import artifacts_of, runs_writing, task_run_states

pytestmark = [pytest.mark.prefect]
LOCAL2 = {"env": "local", "n_workers": 2}


def _shard_runs(states: dict[str, str]) -> dict[str, str]:
    return {name: state for name, state in states.items() if not name.endswith("/merge")}


@pytest.mark.dask
def test_a_task_per_pending_shard_none_on_a_rerun(prefect_harness, tmp_path):
    def runner(out: Path) -> HookLogRunner:
        return HookLogRunner(ListProvider({"n": 30}), batch_size=4, output_dir=str(out), shard_size=5)

    merged = runner_flow(runner(tmp_path / "out"), range(30), parallel=LOCAL2, name="hooks-flow", progress=False)
    reference = runner(tmp_path / "ref")(range(30))
    assert merged["rows"] == reference["rows"] == [f"{i} {2 * i}" for i in range(30)]
    assert [Path(d).name for d in merged["dirs"]] == [Path(d).name for d in reference["dirs"]]
    n_shards = len(merged["dirs"])
    states = task_run_states("hooks-flow", tmp_path / "out", expected=n_shards + 1)
    assert len(_shard_runs(states)) == n_shards and set(states.values()) == {"COMPLETED"}, states
    assert "HookLogRunner/merge" in states
    (run,) = runs_writing("hooks-flow", tmp_path / "out")
    report = artifacts_of(run, "hooks-flow-")["hooks-flow-report"]
    assert f"| Shards computed | {n_shards} |" in report.data and "HookLogRunner" in report.data

    again = runner_flow(runner(tmp_path / "out"), range(30), parallel=LOCAL2, name="hooks-flow", progress=False)
    assert again["tokens"] == merged["tokens"] and again["rows"] == merged["rows"]  # nothing recomputed
    # nothing due: merged in this process as runner(indices) does, no flow run (nor cluster, nor server)
    assert len(runs_writing("hooks-flow", tmp_path / "out")) == 1


def test_inside_a_users_flow_it_is_a_subflow_with_set_parallels_config(prefect_harness, tmp_path):
    @flow(name="users-own-flow")
    def users_flow(n: int) -> list:
        return runner_flow(RecordsRunner(ListProvider({"n": n}), batch_size=3), range(n), progress=False)

    set_parallel({"env": "serial"})
    try:
        assert users_flow(7) == [[{"idx": i, "y": 2 * i} for i in chunk] for chunk in ([0, 1, 2], [3, 4, 5], [6])]
    finally:
        set_parallel(None)

    async def children_of_latest(parent: str) -> list:
        """The flow runs started inside the newest run of the flow ``parent`` (a name only this
        test uses: other tests, and other pytest processes on a shared server, run records-runner)."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import (FlowFilter, FlowFilterName, FlowRunFilter,
                                                    FlowRunFilterParentFlowRunId)
        from prefect.client.schemas.sorting import FlowRunSort

        async with get_client() as client:
            (run,) = await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[parent])),
                                                 sort=FlowRunSort.START_TIME_DESC, limit=1)
            children = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])))
            return [((await client.read_flow(child.flow_id)).name, child.parent_task_run_id) for child in children]

    children = asyncio.run(children_of_latest("users-own-flow"))
    assert [name for name, _ in children] == ["records-runner"] and all(task for _, task in children), children


@pytest.mark.dask
def test_a_worker_killed_mid_flow_resumes_to_the_same_result(prefect_harness, tmp_path):
    marker = tmp_path / "killed"
    runner = ScaleSumRunner(ArrayProvider({"n": 40, "kill_marker": str(marker), "kill_at": 17}),
                            output_dir=str(tmp_path / "out"), shard_size=5)
    merged = runner_flow(runner, range(40), parallel=LOCAL2, progress=False)
    assert marker.exists(), "no worker was killed"
    assert merged == {"sum": 1.5 * sum(range(40)), "n": 40}
    assert merged == ScaleSumRunner(ArrayProvider({"n": 40}), output_dir=str(tmp_path / "ref"), shard_size=5)(range(40))


def test_a_failing_shard_fails_the_flow_naming_it_and_the_others_are_published(prefect_harness, tmp_path):
    with pytest.raises(ShardFailure, match="model exploded on 13") as err:
        runner_flow(FailsOn13Runner(ListProvider({"n": 20}), output_dir=str(tmp_path), shard_size=4), range(20), retries=1,
                    retry_delay_seconds=0.1, progress=False)
    assert "1 shard(s) failed (FailsOn13Runner/split." in str(err.value)
    n_shards = len(json.loads((tmp_path / "manifest.json").read_text())["shards"])
    assert n_shards > 1 and len(list(tmp_path.glob("split.*/done"))) == n_shards - 1


@pytest.mark.s3
@pytest.mark.dask
def test_s3_output(prefect_harness, s3_output):
    url, options = s3_output
    runner = HookLogRunner(ListProvider({"n": 20}), output_dir=url, shard_subdir="job", shard_size=5,
                           storage_options=options)
    merged = runner_flow(runner, range(20), parallel=LOCAL2, progress=False)
    store = Storage(url, options)
    assert merged["rows"] == [f"{i} {2 * i}" for i in range(20)]
    assert merged["merged_file"] == store.uri("rows.txt") and store.read_bytes("rows.txt").decode().splitlines() == \
        merged["rows"]
    assert all(merged["done"]) and len(merged["dirs"]) == len(store.read_json("job", "manifest.json")["shards"])
