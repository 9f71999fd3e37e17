"""Small providers and runners used by the engine tests (importable by Dask workers)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import numpy as np

from espnet3_flows.parallel import BaseRunner, EnvironmentProvider


def _resources(n: int, kill_marker: str | None = None, kill_at: int = -1) -> dict[str, Any]:
    return {"data": np.arange(n, dtype=np.float64) * 0.5, "scale": 3.0, "kill_marker": kill_marker,
            "kill_at": kill_at, "pid": os.getpid()}


class ArrayProvider(EnvironmentProvider):
    """Resources: ``data`` (an array), ``scale``, and an optional crash point for fault tests."""

    def build_env_local(self) -> dict[str, Any]:
        return _resources(self.config["n"], self.config.get("kill_marker"), self.config.get("kill_at", -1))

    def build_worker_setup_fn(self):
        n, marker, at = self.config["n"], self.config.get("kill_marker"), self.config.get("kill_at", -1)
        return lambda: _resources(n, marker, at)


class DictReturningProvider(ArrayProvider):
    """ESPnet3's documented mistake: returns the resources dict itself instead of a function."""

    def build_worker_setup_fn(self):  # type: ignore[override]
        return _resources(self.config["n"])


class ScaleSumRunner(BaseRunner):
    """ESPnet3's writer hooks: ``values.txt`` (``idx value`` per item) in each shard's directory;
    ``merge`` sums the values of every shard's file."""

    @staticmethod
    def forward(idx, data, scale, kill_marker, kill_at):
        ids = idx if isinstance(idx, list) else [idx]
        if kill_marker and kill_at in ids and not Path(kill_marker).exists():
            Path(kill_marker).write_text("killed once")
            os.kill(os.getpid(), signal.SIGKILL)  # the worker dies mid-shard
        return [(i, float(scale * data[i])) for i in ids]

    @staticmethod
    def open_writers(shard_dir, **env):
        return {"values": open(Path(shard_dir) / "values.txt", "w")}

    @staticmethod
    def write_record(writers, result, state, **env):
        for i, v in result:
            writers["values"].write(f"{i} {v!r}\n")
        state["n"] = state.get("n", 0) + len(result)

    def merge(self, shard_dirs):
        values = [float(line.split()[1]) for d in shard_dirs for line in (Path(d) / "values.txt").read_text().splitlines()]
        return {"sum": sum(values), "n": len(values)}


class NeedsMissingKeyRunner(ScaleSumRunner):
    """``forward`` asks for ``model``, which the provider does not supply."""

    @staticmethod
    def forward(idx, data, model):  # type: ignore[override]
        return [(idx, 0.0)]


class PidRunner(ScaleSumRunner):
    """Each item's value is the id of the process its ``forward`` ran in."""

    @staticmethod
    def forward(idx, pid):  # type: ignore[override]
        ids = idx if isinstance(idx, list) else [idx]
        return [(i, float(pid)) for i in ids]

    def merge(self, shard_dirs):
        return {float(line.split()[1]) for d in shard_dirs for line in (Path(d) / "values.txt").read_text().splitlines()}


class SlowPidRunner(PidRunner):
    """:class:`PidRunner` whose items take 20 ms each (a model's work), so that idle workers take shards."""

    @staticmethod
    def forward(idx, pid):  # type: ignore[override]
        import time

        ids = idx if isinstance(idx, list) else [idx]
        time.sleep(0.02 * len(ids))
        return [(i, float(pid)) for i in ids]


class GreedyRunner(ScaleSumRunner):
    """:class:`ScaleSumRunner` whose item ``kill_at`` holds 1 GiB for a few seconds: a worker with a
    smaller ``memory_limit`` is restarted by its nanny while running it."""

    @staticmethod
    def forward(idx, data, scale, kill_marker, kill_at):  # type: ignore[override]
        import time

        ids = idx if isinstance(idx, list) else [idx]
        if kill_at in ids:
            held = np.ones(1 << 27)  # 1 GiB, every page touched
            time.sleep(5)  # the nanny's memory monitor looks every 100 ms
            del held
        return [(i, float(scale * data[i])) for i in ids]
