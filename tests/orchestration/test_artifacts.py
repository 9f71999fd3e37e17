"""The run's artifacts, against the session's Prefect server: few, and a progress artifact whose
updates are bounded however many shards a run has."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.prefect


def test_progress_is_sent_once_per_whole_percent_and_ends_at_100(prefect_harness, monkeypatch):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterId

    from espnet3_flows.orchestration import artifacts

    sent: list[float] = []
    update = artifacts.update_progress_artifact

    def counted(artifact_id, progress):  # the real call, counted
        sent.append(progress)
        return update(artifact_id, progress)

    monkeypatch.setattr(artifacts, "update_progress_artifact", counted)

    @flow(name="progress-bound")
    def shards_finishing() -> artifacts.ProgressArtifact:  # as a run's shards flow meters them
        meter = artifacts.ProgressArtifact("test-progress-bound", total=10_000, done=2_500, interval=0.0)
        for _ in range(7_500):
            meter.advance()
        meter.finish()
        return meter

    meter = shards_finishing()
    assert sent == [float(p) for p in range(26, 101)]  # 7,500 shards: 75 updates, one a point

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(id=ArtifactFilterId(any_=[meter.id])))

    (artifact,) = asyncio.run(read())
    assert float(artifact.data) == 100.0
    meter.finish()  # nothing new to say: nothing sent (and nothing outside a run)
    assert len(sent) == 75
