"""A split's merged outputs as one set: published with ``summary.json`` as the set's record,
stale files of the previous set removed, and the record trusted only while every file it names
still matches its size and digest; and the split directory's owner (``owner.json``: one job, one
output-changing config), so two jobs or configs never mix their outputs there."""

from __future__ import annotations

import json
import logging
import os
import posixpath
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

from espnet3_flows.config import ConfigError
from espnet3_flows.credentials import mask_secrets
from espnet3_flows.errors import clip
from espnet3_flows.hashing import canonical_json
from espnet3_flows.inputs.records import SkippedItem, write_skipped_tsv
from espnet3_flows.published_files import mismatches, publish_recorded, write_recorded
from espnet3_flows.scp import point_scps_at_published
from espnet3_flows.storage import Storage

_LOG = logging.getLogger(__name__)

SUMMARY = "summary.json"


def publish_split_files(store: Storage, rel: str, staged: Sequence[tuple[str, Path]], skipped: Sequence[SkippedItem],
                        summary: dict[str, Any]) -> dict[str, Any]:
    """Replace a split's merged outputs as one set, ``summary.json`` being the set's record.

    In order: ``summary.json`` becomes a ``"merging"`` record (no plan digest, so nothing trusts
    it) naming the files of the old set and of the new one; the ``staged`` files (name, local path:
    list an ark before the scp that points into it) and ``skipped.tsv`` are published; files of
    the old set that the new one lacks are removed (e.g. ``feats_stats.npz`` when every utterance
    was skipped); ``summary.json`` is written last with each file's size and SHA-256 (and ETag on
    S3: ``digests``). Whatever instant this stops at, the split has either the old complete record,
    or a ``merging`` one that the next run merges again (removing what either set left), or the
    new complete record; and a complete record is trusted only while its files match their
    digests (:func:`espnet3_flows.orchestration.job_run.published_summary`). No name leads out of
    the output location: one that would (a directory of the split that is a link to elsewhere)
    raises :class:`~espnet3_flows.confinement.OutsideOutputError` before anything is changed.

    Returns:
        ``summary`` with ``skipped`` (the count), ``files`` (name → URI, ``summary.json`` too) and
        ``digests``; a warning is added when the split has no utterance.
    """
    previous = _recorded_names(store, rel)
    names = [name for name, _ in staged] + ["skipped.tsv"]
    for name in previous:  # a name of the record through a link to elsewhere: refused before any change
        store.checked_path(rel, name, action="remove")
    store.write_json(posixpath.join(rel, SUMMARY), {
        "split": summary.get("split"), "merging": True,
        "files": {name: store.uri(rel, name) for name in dict.fromkeys([*previous, *names])}})
    files, digests = {}, {}
    if staged:  # an scp names its arks where they are published, not in the merge's stage
        point_scps_at_published([(local, posixpath.join(rel, name)) for name, local in staged], store.uri,
                                Path(os.path.commonpath([str(local.parent) for _, local in staged])))
    for name, local in staged:
        digests[name] = publish_recorded(store, local, posixpath.join(rel, name))
        files[name] = store.uri(rel, name)
    skipped_tsv = write_skipped_tsv(list(skipped)).encode("utf-8")
    digests["skipped.tsv"] = write_recorded(store, posixpath.join(rel, "skipped.tsv"), skipped_tsv)
    files["skipped.tsv"] = store.uri(rel, "skipped.tsv")
    for stale in previous:
        if stale not in files:
            store.remove(rel, stale)
    summary = {**summary, "skipped": len(skipped), "files": files, "digests": digests}
    if not summary.get("utterances"):
        warning = (f"split {summary.get('split', rel)}: no utterance was processed ({len(skipped)} skipped, listed "
                   f"in {files['skipped.tsv']}): its outputs describe no data")
        _LOG.warning(warning)
        summary["warnings"] = [*summary.get("warnings", []), warning]
    store.write_json(posixpath.join(rel, SUMMARY), summary)
    summary["files"] = {**files, SUMMARY: store.uri(rel, SUMMARY)}
    return summary


def _recorded_names(store: Storage, rel: str) -> list[str]:
    """The files a split's ``summary.json`` names (complete or ``merging``), relative to the
    split's directory; none when it is missing or unreadable. Only plain relative names are
    kept: the record names files to remove, never a path outside the split."""
    try:
        recorded = store.read_json(posixpath.join(rel, SUMMARY))
        names = list((recorded or {}).get("files") or {})
    except (ValueError, AttributeError):
        return []
    return [n for n in names if isinstance(n, str) and n and n != SUMMARY and not n.startswith("/")
            and ".." not in n.split("/")]


def trusted_summary(store: Storage, rel: str, plan_digest: str) -> dict[str, Any] | None:
    """The split's ``summary.json`` when it is the complete record of a merge of exactly the plan
    ``plan_digest`` and every file it names still matches its size and digest; else ``None`` (the
    split is merged again), with a warning naming a file that differs or a record that cannot be
    read. Records written before digests were kept are trusted on their plan digest alone."""
    try:
        summary = store.read_json(posixpath.join(rel, SUMMARY))
    except ValueError as exc:
        _LOG.warning("%s is unreadable (%s): the split is merged again", store.uri(rel, SUMMARY), type(exc).__name__)
        return None
    if not isinstance(summary, Mapping) or summary.get("merging") or summary.get("plan_digest") != plan_digest:
        return None
    digests = summary.get("digests") or {}
    bad = mismatches(store, {posixpath.join(rel, name): d for name, d in digests.items()})
    if bad:
        where, why = next(iter(bad.items()))
        _LOG.warning("%s does not match %s (%s): the split is merged again", store.uri(where),
                     store.uri(rel, SUMMARY), why)
        return None
    return dict(summary)


OWNER = "owner.json"


class OutputsOwnedError(ConfigError):
    """A split's output directory holds another job's outputs, or the same job's made with a
    config that changes them: a run there would mix two sets."""


def claim_outputs(store: Storage, rel: str, job: str, config: Mapping[str, Any]) -> None:
    """Make the split directory ``rel`` this job's (``owner.json``: the job and the part of its
    config that changes outputs), or check that it is already.

    The record is created once, exclusively (a hard link on a local store, a conditional PUT,
    ``If-None-Match: *``, on S3): two runs that start together cannot both claim it. It is read
    back after it is written, for stores whose create only checks first (``memory://``, others).
    A record that names no owner (empty, truncated, not JSON) is replaced, with a warning naming it.

    Raises:
        OutputsOwnedError: the directory belongs to another job or another config; the message
            names what differs and how to proceed.
    """
    mine = _owner_record(job, config)
    owner_rel = posixpath.join(rel, OWNER)
    found = _read_owner(store, owner_rel)
    if found is None:
        _create_exclusive(store, owner_rel, mine)
        found = _read_owner(store, owner_rel)
    if isinstance(found, _Unreadable):  # it cannot name an owner: replaced, with a warning naming it
        found = _replace_unreadable(store, owner_rel, mine, found)
    what = _conflict(found, mine)
    if what is not None:
        raise owned_error(job, [(store.uri(rel), store.uri(owner_rel), what)])


def owned_error(job: str, conflicts: Sequence[tuple[str, str, str]]) -> OutputsOwnedError:
    """The one-line refusal of a run whose split directories are another's: ``conflicts`` are
    ``(directory, its owner.json, what holds it)``, directories held alike named together."""
    held: dict[str, list[tuple[str, str]]] = {}
    for directory, owner, what in conflicts:
        held.setdefault(what, []).append((directory, owner))
    named = "; ".join(f"{', '.join(d for d, _ in dirs)} {'holds' if len(dirs) == 1 else 'hold'} {what}"
                      for what, dirs in held.items())
    owners = ", ".join(o for dirs in held.values() for _, o in dirs)
    return OutputsOwnedError(f"{named}; this run ({job}) would mix its outputs with them: use another output "
                             f"directory, or remove {owners} to replace them")


def owner_conflict(store: Storage, rel: str, job: str, config: Mapping[str, Any]) -> str | None:
    """What makes the split directory ``rel`` another job's or another config's, as
    :func:`claim_outputs` would say it (``None``: no owner yet, an unreadable one, or this job
    and config); reads only."""
    found = _read_owner(store, posixpath.join(rel, OWNER))
    return None if found is None or isinstance(found, _Unreadable) else _conflict(found, _owner_record(job, config))


def _owner_record(job: str, config: Mapping[str, Any]) -> dict[str, Any]:
    return {"job": job, "config": to_jsonable(mask_secrets(config))}  # a model's kwargs may hold a token


def _conflict(found: Any, mine: dict[str, Any]) -> str | None:
    if found == mine:
        return None
    theirs = found if isinstance(found, Mapping) else {}
    return (f"the outputs of {theirs.get('job')}" if theirs.get("job") != mine["job"] else
            f"{mine['job']} outputs made with {_differences(theirs.get('config'), mine['config'])}")


class _Unreadable(str):
    """Why an ``owner.json`` names no owner (empty, truncated, not JSON, not an owner record)."""


def _read_owner(store: Storage, rel: str) -> Any:
    """The owner record at ``rel``: ``None`` when there is none, an :class:`_Unreadable` (why)
    when the file there names no owner."""
    try:
        found = store.read_json(rel)
    except ValueError as exc:  # empty, truncated, not UTF-8 (JSONDecodeError, UnicodeDecodeError)
        return _Unreadable(clip(f"{type(exc).__name__}: {exc}"))
    if found is None or (isinstance(found, Mapping) and isinstance(found.get("job"), str)):
        return found
    return _Unreadable(f"not an owner record: {clip(json.dumps(found), 80)}")


def _replace_unreadable(store: Storage, rel: str, mine: Mapping[str, Any], why: str) -> Any:
    """Replace an ``owner.json`` that names no owner with this run's claim (removed, then created
    exclusively: a run that claims at the same moment either wins or is compared as usual); the
    record found then. A warning names the file and why it was unreadable.

    Raises:
        OutputsOwnedError: the file is still unreadable after it was replaced (another process
            writing it): the message names it.
    """
    _LOG.warning("%s is unreadable (%s): it names no owner and is replaced by this run's", store.uri(rel), why)
    store.remove(rel)
    _create_exclusive(store, rel, mine)
    found = _read_owner(store, rel)
    if isinstance(found, _Unreadable):
        raise OutputsOwnedError(f"{store.uri(rel)} is unreadable ({found}) even after this run replaced it: "
                                "is another process writing it? Remove it and run again")
    return found


def _create_exclusive(store: Storage, rel: str, record: Mapping[str, Any]) -> None:
    """Write ``record`` at ``rel`` unless a record is there already: exclusive on a local store and
    on S3 (a conditional PUT: of two runs that claim together, one writes and the other gets 412
    and reads the winner's record), never replacing another run's (:meth:`Storage.create_json`)."""
    store.create_json(rel, record)


def _differences(old: Any, new: Any, limit: int = 3) -> str:
    """The first ``limit`` config keys whose values differ, as ``key=old (this run: new)``."""
    a, b = _flat(old), _flat(new)
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    shown = [clip(f"{k}={a.get(k)!r} (this run: {b.get(k)!r})", 120) for k in keys[:limit]]
    return ", ".join(shown) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, Mapping):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): obj}


def to_jsonable(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (tuples as lists, keys as strings)."""
    return json.loads(canonical_json(obj))
