"""A local worker that dies is restarted from the forkserver, not spawned, and the start method
is set only while the nanny's own code runs."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing.forkserver
import os
import signal
import sys
import time

import dask
import pytest

from espnet3_flows.parallel import ParallelConfig, get_client
from espnet3_flows.parallel.forking_nanny import _UnderConfig
from espnet3_flows.parallel.forkserver import MP_METHOD_KEY, start_forkserver, stop_forkserver

PRELOAD = "colorsys"  # a stdlib module nothing else here imports


def _worker_view() -> tuple[int, int, bool]:
    return os.getpid(), os.getppid(), PRELOAD in sys.modules


def test_the_method_is_set_while_the_coroutine_runs_and_only_then():
    default = dask.config.get(MP_METHOD_KEY)
    seen: dict[str, list[str]] = {"forking": [], "other": []}

    async def look(name: str, steps: int) -> str:
        for _ in range(steps):
            seen[name].append(dask.config.get(MP_METHOD_KEY))
            await asyncio.sleep(0)  # the other coroutine runs here
        return name

    async def both() -> list[str]:
        # two under the setting, one beside them, all interleaved on one loop
        return await asyncio.gather(_UnderConfig(look("forking", 4), {MP_METHOD_KEY: "forkserver"}),
                                    look("other", 6),
                                    _UnderConfig(look("forking", 3), {MP_METHOD_KEY: "forkserver"}))

    assert asyncio.run(both()) == ["forking", "other", "forking"]
    assert seen["forking"] == ["forkserver"] * 7 and seen["other"] == [default] * 6
    assert dask.config.get(MP_METHOD_KEY) == default


def test_an_error_and_a_cancellation_reach_the_coroutine_and_leave_the_setting_unset():
    default = dask.config.get(MP_METHOD_KEY)
    cleanup: list[str] = []

    async def fails() -> None:
        await asyncio.sleep(0)
        raise ValueError("from the coroutine")

    async def waits() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cleanup.append(dask.config.get(MP_METHOD_KEY))

    async def run() -> None:
        with pytest.raises(ValueError, match="from the coroutine"):
            await _UnderConfig(fails(), {MP_METHOD_KEY: "forkserver"})
        task = asyncio.ensure_future(_UnderConfig(waits(), {MP_METHOD_KEY: "forkserver"}))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert cleanup == ["forkserver"]  # its finally ran under the setting, as its own code
    assert dask.config.get(MP_METHOD_KEY) == default


@pytest.fixture
def fresh_forkserver():
    stop_forkserver()
    sys.modules.pop(PRELOAD, None)
    yield
    stop_forkserver()


@pytest.mark.patch
@pytest.mark.dask
def test_a_killed_worker_is_restarted_from_the_forkserver(fresh_forkserver):
    assert start_forkserver([PRELOAD])
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    with get_client(config=ParallelConfig(env="local", n_workers=1), wait_for_workers=1) as client:
        [(first, parent, preloaded)] = client.run(_worker_view).values()
        assert parent == server and preloaded
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while True:  # the nanny restarts it; the scheduler may still list the dead one a moment
            with contextlib.suppress(Exception):
                views = list(client.run(_worker_view).values())
                if views and views[0][0] != first:
                    break
            assert time.monotonic() < deadline, "the killed worker was not restarted in 90 s"
            time.sleep(0.2)
        [(second, parent, preloaded)] = views
    # forked by the same server, its imports already done: not a spawned interpreter of this process
    assert parent == server and preloaded, (second, parent, os.getpid())
