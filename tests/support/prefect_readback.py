"""Reading back everything a Prefect server hands out (flow and task runs, states, blocks,
artifacts, logs, events, ...) and finding where a string occurs in it or in its database file:
the checks that no credential reached the server."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

PAGE = 200  # the server's default maximum page size
EVENTS_PAGE = 50  # POST /events/filter accepts at most 50


def _dump(model: Any) -> Any:
    return model.model_dump(mode="json") if hasattr(model, "model_dump") else model


async def read_all(read, **kwargs) -> list[Any]:
    """Every record a paged ``client.read_*`` method returns, page by page: one call returns at
    most ``PAGE`` (a shared test server holds more than that, in no order a test can rely on)."""
    out: list[Any] = []
    while True:
        page = await read(limit=PAGE, offset=len(out), **kwargs)
        out.extend(page)
        if len(page) < PAGE:
            return out


def runs_writing(flow_name: str, output_dir: str | os.PathLike, newest_only: bool = False) -> list[Any]:
    """The flow runs named ``flow_name`` on the session's server whose shown config writes to
    ``output_dir`` (the ``config`` parameter of :func:`~espnet3_flows.orchestration.flows.shard_flow`),
    newest first: a test's own, among every other test's (and, on the run's shared server, every
    other pytest process's) runs of the same flow. ``newest_only``: stop at the first found."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    wanted = os.path.normpath(os.fspath(output_dir))

    def writes_there(run: Any) -> bool:
        config = (run.parameters or {}).get("config")
        return isinstance(config, dict) and os.path.normpath(str(config.get("output_dir"))) == wanted

    async def read() -> list[Any]:
        found: list[Any] = []
        async with get_client() as client:
            offset = 0
            while True:  # newest first: a test's own run is on the first page, unless thousands came after it
                page = await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])),
                                                   sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=PAGE,
                                                   offset=offset)
                found += [run for run in page if writes_there(run)]
                offset += len(page)
                if len(page) < PAGE or (newest_only and found):
                    return found[:1] if newest_only else found

    return asyncio.run(read())


def task_run_states(flow_name: str, output_dir: str | os.PathLike, expected: int = 0,
                    timeout: float = 60.0) -> dict[str, str]:
    """Task run name → state type of the newest run of ``flow_name`` writing to ``output_dir``,
    once the API has recorded every one as final and at least ``expected`` of them (the server
    records task runs from events, a moment after they are sent), or as they are after ``timeout``."""
    import asyncio
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    (run,) = runs_writing(flow_name, output_dir, newest_only=True) or [None]
    assert run is not None, f"no {flow_name} flow run writing to {output_dir} on the server"

    async def read() -> dict[str, str]:
        async with get_client() as client:
            tasks = await read_all(client.read_task_runs, flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
            return {t.name: t.state_type.value if t.state_type else "NONE" for t in tasks}

    deadline = time.monotonic() + timeout
    while True:
        states = asyncio.run(read())
        final = all(s in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for s in states.values())
        if (final and len(states) >= expected) or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


def artifacts_of(flow_run: Any, prefix: str) -> dict[str, Any]:
    """Key → artifact, for the artifacts ``flow_run`` published whose key starts with ``prefix``
    (the latest of each key)."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    async def read() -> list[Any]:
        async with get_client() as client:
            return await read_all(client.read_artifacts, artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(like_=prefix), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id])))

    found = sorted(asyncio.run(read()), key=lambda a: a.created)
    return {a.key: a for a in found if a.key and a.key.startswith(prefix)}


async def read_everything(api_url: str, pool: str) -> dict[str, Any]:
    """Everything a user of the API at ``api_url`` can read back (``pool``: the work pool whose
    workers are read), as JSON-ready data."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        async with get_client() as client:
            http = client._client  # the API's httpx client (base URL = api_url)
            flow_runs = await read_all(client.read_flow_runs)
            task_runs = await read_all(client.read_task_runs)
            dump: dict[str, Any] = {
                "flow_runs": [_dump(r) for r in flow_runs],
                "flow_run_states": {str(r.id): [_dump(s) for s in await client.read_flow_run_states(r.id)]
                                    for r in flow_runs},
                "task_runs": [_dump(r) for r in task_runs],
                "task_run_states": {str(r.id): [_dump(s) for s in await client.read_task_run_states(r.id)]
                                    for r in task_runs},
                "flows": [_dump(f) for f in await read_all(client.read_flows)],
                "deployments": [_dump(d) for d in await read_all(client.read_deployments)],
                "work_pools": [_dump(p) for p in await client.read_work_pools()],
                "workers": [_dump(w) for w in await client.read_workers_for_work_pool(pool)],
                "block_documents": [_dump(b) for b in await client.read_block_documents(include_secrets=False)],
                "artifacts": [_dump(a) for a in await read_all(client.read_artifacts)],
                "logs": [_dump(entry) for entry in await read_all(client.read_logs)],
                "variables": [_dump(v) for v in await client.read_variables()],
            }
            for name, body in (("block_documents_raw", {}),
                               ("block_documents_raw_no_secrets", {"include_secrets": False})):
                response = await http.post("/block_documents/filter", json=body)
                response.raise_for_status()
                dump[name] = response.json()
            dump["events"] = await _events(http)
            return dump


async def _events(http: Any) -> list[Any]:
    """Every event the API at ``http``'s base URL hands out, page by page."""
    events: list[Any] = []
    response = await http.post("/events/filter", json={"limit": EVENTS_PAGE})
    response.raise_for_status()
    page = response.json()
    events.extend(page["events"])
    while page.get("next_page"):
        response = await http.get(page["next_page"])
        response.raise_for_status()
        page = response.json()
        events.extend(page["events"])
    return events


async def wait_for_final_events(api_url: str, timeout: float = 60.0) -> None:
    """Return once the server has persisted, for every flow run in a final state, the event of
    that state (the server writes events in batches, after the state itself); ``TimeoutError``
    naming the runs still without one after ``timeout`` seconds."""
    import asyncio
    import time

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + timeout
    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        async with get_client() as client:
            while True:
                final = {f"prefect.flow-run.{r.id}": r.state.name for r in await read_all(client.read_flow_runs)
                         if r.state is not None and r.state.is_final()}
                seen = {(e["resource"]["prefect.resource.id"], e["event"]) for e in await _events(client._client)}
                missing = [rid for rid, name in final.items() if (rid, f"prefect.flow-run.{name}") not in seen]
                if not missing:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no final-state event after {timeout:g} s for {missing}")
                await asyncio.sleep(0.2)


def paths_containing(obj: Any, needle: str, path: str = "") -> list[str]:
    """JSON paths of every string (value or key) that contains `needle`."""
    found: list[str] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            sub = f"{path}.{key}" if path else str(key)
            if needle in str(key):
                found.append(sub + " (key)")
            found.extend(paths_containing(value, needle, sub))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            found.extend(paths_containing(value, needle, f"{path}[{i}]"))
    elif needle in str(obj):
        found.append(path)
    return found


def context(text: str, needle: str, width: int = 160) -> str:
    at = text.find(needle)
    return "" if at < 0 else text[max(0, at - width):at + len(needle) + width]


def columns_with(db: Path, needle: str) -> list[str]:
    """`table.column` of every text/blob cell containing `needle` (diagnosis only, on a copy)."""
    found: list[str] = []
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
            for table in tables:
                for col in [r[1] for r in con.execute(f'PRAGMA table_info("{table}")')]:
                    hits = con.execute(f'SELECT count(*) FROM "{table}" WHERE CAST("{col}" AS TEXT) LIKE ?',
                                       (f"%{needle}%",)).fetchone()[0]
                    if hits:
                        found.append(f"{table}.{col} ({hits} rows)")
        finally:
            con.close()
    except sqlite3.Error as exc:
        found.append(f"(could not inspect: {exc})")
    return found
