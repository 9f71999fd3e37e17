"""Prefect artifacts a person reads in the UI: per-split report, links to outputs, progress."""

from __future__ import annotations

import base64
import re
import time
from typing import Any
from collections.abc import Mapping

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from espnet3_flows.orchestration.api_watch import api_call, api_call_soon
from espnet3_flows.storage import Storage

_ROWS = [("utterances", "Utterances"), ("seconds", "Audio (s)"), ("frames", "Frames"), ("feature_dim", "Feature dim"),
         ("embedding_dim", "Embedding dim"), ("speakers", "Speakers"), ("shards", "Shards"),
         ("shards_computed", "Shards computed"), ("shards_cached", "Shards cached"), ("skipped", "Skipped items"),
         ("throughput_utt_per_s", "Throughput (utt/s)"), ("realtime_factor", "× realtime"),
         ("padding_fraction", "Padding (share of samples computed)")]


def artifact_key(*parts: str) -> str:
    """A valid artifact key (lowercase letters, digits and dashes)."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")[:100]


def _link(uri: str) -> str:
    return uri if "://" in uri else f"file://{uri}"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.2f}"
    if isinstance(v, int):
        return f"{v:,}"
    return "—" if v is None else str(v)


def publish_split_artifacts(job: str, summary: Mapping[str, Any], store: Storage, rel: str) -> None:
    """The split's markdown report: its figures, a link to each published file and the plot inline.

    One artifact a split (a link artifact per file made a dozen API calls a split, and as many
    events in a run's ``--watch``, around the job's own lines). ``rel`` is the split's output
    directory relative to the storage root.
    """
    split = summary["split"]
    lines = [f"# {job}: split `{split}`", "", "| metric | value |", "|---|---|"]
    lines += [f"| {label} | {_fmt(summary[key])} |" for key, label in _ROWS if key in summary]
    files = summary.get("files", {})
    if files:
        lines += ["", "## Published files", ""] + [f"- [{name}]({_link(uri)})" for name, uri in sorted(files.items())]
    if "stats.png" in files:
        png = store.read_bytes(rel, "stats.png")
        lines += ["", "## Statistics", "", f"![per-dimension mean ± std and lengths](data:image/png;base64,"
                  f"{base64.b64encode(png).decode()})"]
    if summary.get("skipped"):
        lines += ["", f"**{summary['skipped']} item(s) skipped**: see [skipped.tsv]({_link(files.get('skipped.tsv', ''))})."]
    create_markdown_artifact("\n".join(lines), key=artifact_key(job, split, "report"),
                             description=f"{job} {split}: summary")


def publish_table_artifact(job: str, summaries: list[Mapping[str, Any]]) -> None:
    """One table with a row per split."""
    rows = [{label: summary.get(key) for key, label in [("split", "split"), *_ROWS] if key in summary}
            for summary in summaries]
    create_table_artifact(rows, key=artifact_key(job, "splits"), description=f"{job}: all splits")


def publish_runner_artifact(title: str, planned: Any, merged: Any, wall: float) -> None:
    """A report of a runner's run (:func:`~espnet3_flows.orchestration.flows.runner_flow`): the
    runner, its output, shards computed and reused, and what ``merge`` returned."""
    runner, shards = planned.runner, planned.statuses
    cls = type(runner)
    store = runner.storage
    rows = [("Runner", f"`{cls.__module__}.{cls.__qualname__}`"),
            ("Output", f"[{store.uri(runner.shard_subdir)}]({_link(store.uri(runner.shard_subdir))})" if store else "—"),
            ("Items", _fmt(planned.plan.num_items)), ("Shards", _fmt(len(shards))),
            ("Shards computed", _fmt(sum(not s.cached for s in shards))),
            ("Shards cached", _fmt(sum(s.cached for s in shards))), ("Wall (s)", _fmt(wall)),
            ("Merge returned", _describe(merged))]
    lines = [f"# {title}", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    create_markdown_artifact("\n".join(lines), key=artifact_key(title, "report"), description=f"{title}: summary")


def _describe(value: Any) -> str:
    if isinstance(value, Mapping):
        keys = ", ".join(f"`{k}`" for k in list(value)[:12])
        return f"a dict of {len(value)} key(s): {keys}" + (" …" if len(value) > 12 else "")
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value):,} item(s)"
    return "nothing" if value is None else f"a {type(value).__name__}"


class ProgressArtifact:
    """A progress artifact updated as shards finish (a percentage in the UI).

    An update is sent when the percentage has moved by a whole point and ``interval`` seconds
    have passed since the last one: at most ~100 a run however long it is (each is an API call,
    and an event in ``prefect deployment run --watch``, beside the job's own lines); while a run's
    API is watched, in the background, one at a time (a shard's end never waits on them), and
    none once the API is lost (:mod:`~espnet3_flows.orchestration.api_watch`).
    """

    def __init__(self, job: str, total: int, done: int = 0, interval: float = 2.0):
        self.total = max(1, total)
        self.done = done
        self.interval = interval
        self._sent = time.monotonic()
        self._sending: Any = None
        self.shown = self._percent()  # the last percentage sent
        self.id = api_call(create_progress_artifact, self._percent(), key=artifact_key(job, "progress"),
                           description=f"{job}: shards done")

    def _percent(self) -> float:
        return min(100.0, 100.0 * self.done / self.total)

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more finished shards."""
        self.done += n
        if int(self._percent()) > self.shown and time.monotonic() - self._sent >= self.interval \
                and not (self._sending and self._sending.is_alive()):
            self._sent, self.shown = time.monotonic(), self._percent()
            if self.id is not None:
                self._sending = api_call_soon(update_progress_artifact, self.id, self._percent())

    def finish(self) -> None:
        """Send the current percentage now, unless it was the last one sent."""
        self._sent = time.monotonic()
        if self.id is not None and self._percent() != self.shown:
            self.shown = self._percent()
            api_call(update_progress_artifact, self.id, self.shown)
