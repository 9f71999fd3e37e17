"""One shard's lifecycle, ESPnet3's hooks on a local staging directory that mirrors the output:
``init_state`` (``open_writers``) → per item or batch ``forward`` and ``reduce_state``
(``write_record``) → ``finalize_state`` (``close_writers``) → every staged file published → the
``done`` record, last.

The hooks see ``output_dir`` as the staging directory and ``shard_dir`` inside it, so a writer
written for ESPnet3 writes where it always does; what it leaves there is published to the same
place under the real output location (the shard's own directory to its content-addressed
``split.<hash>``), atomically per file, and only once the shard finished; a Kaldi scp among them
names its arks by their published URIs (:mod:`espnet3_flows.scp`). A shard that fails publishes
nothing.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

from espnet3_flows.errors import ItemError
from espnet3_flows.parallel.injection import call_with_resources, injected
from espnet3_flows.parallel.results import ShardResult
from espnet3_flows.parallel.shard_runner import ShardRunner
from espnet3_flows.published_files import publish_recorded
from espnet3_flows.scp import point_scps_at_published
from espnet3_flows.sharding import Shard

DONE = "done"
RECORDS = "records.json"
#: ``batch_size`` value for one ``forward`` call with all of a shard's items (a job that batches
#: within the shard itself, e.g. length-sorted model batches)
WHOLE_SHARD = "shard"
#: State entries that are the engine's, not the shard's result
_STATE_INTERNALS = ("_writers", "records", "shard_dir")


def batches(items: Sequence[Any], size: int | str | None) -> list[Any]:
    """The ``idx`` of each ``forward`` call: each item (``size`` None), lists of ``size`` items,
    or one list of all of them (``size`` :data:`WHOLE_SHARD`)."""
    if size == WHOLE_SHARD:
        return [list(items)] if len(items) else []
    if not size:
        return list(items)
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


def run_shard(runner: ShardRunner, shard: Shard, resources: Mapping[str, Any], run_id: str = "") -> ShardResult:
    """Compute one shard with the worker's ``resources`` and publish it (files first, ``done`` last);
    ``run_id`` names the run in its ``done`` record. Resuming, a matching ``done`` record found
    once the shard is computed (another run on the same output published it meanwhile) is kept,
    with its files, and this computation's outputs are dropped.

    Returns:
        The shard's ``done`` record.
    """
    resources = runner.shard_resources(shard, resources)
    runner.check_resource_keys(list(resources))
    t0 = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f"espnet3-{shard.name}-", dir=runner.staging_dir))
    try:
        expected = staging.joinpath(runner.shard_subdir, shard.name)
        hook_resources = {**resources, "output_dir": str(staging), "shard_subdir": runner.shard_subdir}
        state = call_with_resources(runner.init_state, shard_id=shard.index, shard_name=shard.name, **hook_resources)
        forward_kwargs = injected(runner.forward, hook_resources, 1)
        skipped: list[dict[str, Any]] = []
        for idx in batches(shard.items, runner.batch_size):
            for out in _forward_checked(runner, idx, forward_kwargs, resources, skipped):
                state = _kept(state, call_with_resources(runner.reduce_state, state, out, shard_id=shard.index,
                                                         **hook_resources))
        state = _kept(state, call_with_resources(runner.finalize_state, state, shard_id=shard.index, **hook_resources))
        staged = Path(state["shard_dir"]) if isinstance(state, Mapping) and state.get("shard_dir") else expected
        res = ShardResult(shard, state_summary(state), [], skipped, run_id=run_id)
        records = state.get("records") if isinstance(state, Mapping) else None
        if records:
            _keep_records(records, staged if _inside(staged, staging) else expected, res)
        res.seconds = time.perf_counter() - t0
        theirs = runner.load_done(shard)
        if theirs is not None:  # another run on this output published the shard while this one computed it
            return theirs
        _publish(runner, shard, staging, {staged, expected}, res)
        return res
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _kept(state: Any, returned: Any) -> Any:
    """A hook's returned state, or the state it changed in place when it returned nothing."""
    return state if returned is None else returned


def _forward_checked(runner: ShardRunner, idx: Any, kwargs: dict[str, Any], resources: Mapping[str, Any],
                     skipped: list[dict[str, Any]]) -> list[Any]:
    """``forward``'s results for ``idx`` (a list of them, or none): a bad item is found and skipped
    or raised per ``on_error``. A batch with a bad item is cut in halves, each run again (cut
    again where it fails), so the good items keep being computed in batches: one bad item of a
    whole shard's call costs about two more passes over the shard, not a call per item."""
    try:
        return [runner.forward(idx, **kwargs)]
    except runner.item_errors as exc:
        if isinstance(idx, list) and len(idx) > 1:
            half = len(idx) // 2
            return (_forward_checked(runner, idx[:half], kwargs, resources, skipped)
                    + _forward_checked(runner, idx[half:], kwargs, resources, skipped))
        first = idx[0] if isinstance(idx, list) else idx
        _bad_item(runner, first, resources, exc, skipped)
        return []


def _bad_item(runner: ShardRunner, item: Any, resources: Mapping[str, Any], exc: BaseException,
              skipped: list[dict[str, Any]]) -> None:
    if runner.on_error == "skip":
        skipped.append(runner.skip_record(item, resources, exc))
        return
    raise ItemError(f"{runner.describe_item(item, resources)}: {exc}") from exc


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def _keep_records(records: Any, shard_dir: Path, res: ShardResult) -> None:
    """Write ESPnet3's default ``records`` as the shard's ``records.json`` (read by the default
    ``merge``); records that are not JSON-able are not kept, and ``done`` says why."""
    try:
        text = json.dumps(json_safe(records, strict=True), allow_nan=False)
    except (TypeError, ValueError) as exc:
        res.records_error = f"{type(exc).__name__}: {exc}"
        return
    shard_dir.mkdir(parents=True, exist_ok=True)
    (shard_dir / RECORDS).write_text(text, encoding="utf-8")
    res.records = len(records) if isinstance(records, Sequence) else 1


def _publish(runner: ShardRunner, shard: Shard, staging: Path, shard_dirs: set[Path], res: ShardResult) -> None:
    """Publish what the shard left under ``staging``: files outside its directory to the same
    place under the output (first: an scp in the shard's directory may point at them), then the
    shard directory's files to ``split.<hash>`` (each one's size, SHA-256 and ETag kept in ``done``),
    then ``done``.

    A ``done`` record already there goes first, so no instant pairs it with a mix of old and new
    files. Resuming, one is there only when it is not this shard's (unreadable, another hash, or
    failing the runner's ``is_shard_done``; a matching one was kept instead, by ``run_shard``):
    where none is there nothing is removed, so a run merging this output at the same time (one
    that published this shard a moment before) never finds it missing."""
    store = runner.storage
    assert store is not None, "a shard runs with an output location"
    done_rel = runner.shard_rel(shard, DONE)
    if not runner.resume or store.exists(done_rel):
        store.remove(done_rel)
    roots = sorted((d.resolve() for d in shard_dirs), key=lambda d: -len(d.parts))
    elsewhere: list[tuple[Path, str]] = []
    inside: list[tuple[Path, str]] = []
    for path in sorted(p for p in staging.rglob("*") if p.is_file()):
        resolved = path.resolve()
        root = next((r for r in roots if resolved.is_relative_to(r)), None)
        if root is None:
            elsewhere.append((path, path.relative_to(staging).as_posix()))
        else:
            inside.append((path, runner.shard_rel(shard, resolved.relative_to(root).as_posix())))
    point_scps_at_published([*elsewhere, *inside], store.uri, staging)  # no scp names the staging dir
    for path, rel in elsewhere:
        store.publish_file(path, rel)
    res.published_elsewhere = len(elsewhere)
    for path, rel in inside:
        res.digests[rel] = publish_recorded(store, path, rel)
        res.files.append(rel)
    store.write_json(done_rel, res.to_dict())


def state_summary(state: Any) -> Any:
    """The JSON-able part of a shard's final state, kept in its ``done`` record: a dict state
    without the engine's entries (writers, records, directory), values converted where they can
    be (numpy, paths, tuples), others named by type."""
    if isinstance(state, Mapping):
        state = {k: v for k, v in state.items() if k not in _STATE_INTERNALS}
    return json_safe(state, strict=False)


def json_safe(obj: Any, strict: bool = True) -> Any:
    """``obj`` as plain JSON data: numpy arrays and scalars, tensors, paths, tuples and sets
    converted, non-finite floats as ``None``. An object of another kind raises ``TypeError``
    (``strict``) or becomes ``"<TypeName>"``."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v, strict) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v, strict) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return [json_safe(v, strict) for v in sorted(obj, key=repr)]
    if isinstance(obj, Path):
        return str(obj)
    tolist = getattr(obj, "tolist", None)  # numpy arrays and scalars, torch tensors
    if callable(tolist) and type(obj).__module__.split(".")[0] in ("numpy", "torch"):
        return json_safe(tolist(), strict)
    if strict:
        raise TypeError(f"{type(obj).__name__} is not JSON-able")
    return f"<{type(obj).__name__}>"
