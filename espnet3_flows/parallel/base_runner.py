"""BaseRunner: ESPnet3's runner contract exactly (static ``forward``, writer hooks, state hooks,
``merge(shard_dirs)``, ``split.*/done``), with content-addressed shards, local staging and atomic
publishing, S3 outputs, bad-item policies and retries underneath.

A runner written against ESPnet3's ``espnet3.parallel.base_runner.BaseRunner`` runs here with its
imports changed to ``espnet3_flows.parallel.base_runner``: ``runner(indices)`` returns what its
``merge`` returns, locally or on Dask, and
:func:`espnet3_flows.orchestration.runner_flow` runs the same lifecycle as a Prefect flow.
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Mapping, Sequence

import fsspec

from espnet3_flows.config import check_on_error
from espnet3_flows.errors import BadItemError, ItemError
from espnet3_flows.parallel.injection import call_with_resources, missing_keys
from espnet3_flows.parallel.env_provider import ProviderError
from espnet3_flows.parallel.main_guard import refuse_while_importing_main
from espnet3_flows.parallel.results import RunOutcome, ShardResult, ShardStatus
from espnet3_flows.parallel.shard_lifecycle import DONE, WHOLE_SHARD, run_shard
from espnet3_flows.parallel.shard_records import ShardRecords, is_local_url
from espnet3_flows.hashing import runner_item_key
from espnet3_flows.sharding import Shard, ShardPlan, plan_item, plan_shards, split_shard_size
from espnet3_flows.storage import Storage

PLAN = "manifest.json"
_LOG = logging.getLogger(__name__)

__all__ = ["BaseRunner", "DONE", "ItemError", "PLAN", "WHOLE_SHARD", "concatenate_shard_files"]

#: Runner hooks' earlier names (they said "env" for the worker's resources) → their current names.
#: On every runner class both names are one method, so a subclass written for either is called.
EARLIER_HOOK_NAMES = {"shard_env": "shard_resources", "shard_env_keys": "shard_resource_keys",
                      "check_env_keys": "check_resource_keys"}


def _keep_earlier_hook_names(cls: type) -> None:
    """Give ``cls`` each hook of :data:`EARLIER_HOOK_NAMES` under both of its names: the nearest
    class in its MRO that defines either name lends its method to the name it lacks.

    So a subclass that overrides only ``shard_env`` is called when the engine asks for
    ``shard_resources``, and its ``super().shard_env(...)`` reaches the next class's
    ``shard_resources`` (the job runners' included), as before the rename.
    """
    for earlier, name in EARLIER_HOOK_NAMES.items():
        owner = next((k for k in cls.__mro__ if earlier in vars(k) or name in vars(k)), None)
        if owner is None:
            continue
        if name not in vars(owner):
            setattr(cls, name, vars(owner)[earlier])
        elif earlier not in vars(owner):
            setattr(cls, earlier, vars(owner)[name])


class BaseRunner(ShardRecords):
    """Runs ``forward`` over items, shard by shard, with ESPnet3's hooks and names.

    Per shard: ``init_state`` (which calls ``open_writers(shard_dir, **resources)``) → for each
    item, or list of ``batch_size`` items, ``forward(idx, **resources)`` and ``reduce_state`` (which
    calls ``write_record(writers, result, state, **resources)``) → ``finalize_state`` (which calls
    ``close_writers(writers, state, **resources)`` and merges the dict it returns into the state) →
    ``done``. Once every shard is done, ``merge(shard_dirs)`` gets the completed shard
    directories in plan order, and ``runner(indices)`` returns what it returns.

    The worker's resources reach ``forward`` and every hook by parameter name (all of them where
    it takes ``**kwargs``; ESPnet3's runners write ``**env``): the provider's dict, ``output_dir``
    and ``shard_subdir`` (and ``shard_id`` in the writer and state hooks), as in ESPnet3.

    Underneath, invisible to such a runner: shards are content defined and named by their
    content hash (``split.<16 hex digits>``), so a rerun skips exactly the unchanged ones;
    ``shard_dir`` and ``output_dir`` in the hooks are a local staging directory whose files are
    published to the same places under the real ``output_dir`` when the shard finishes, then
    ``done``, last, with the shard hash; a bad item (:class:`~espnet3_flows.errors.BadItemError`)
    is skipped or fails the run per ``on_error``; the output may be any fsspec URL (S3).

    Args:
        provider: Builds the resources (model, dataset) once per process or worker (an
            :class:`~.env_provider.EnvironmentProvider` or any object with ESPnet3's two methods).
        batch_size: Items per ``forward`` call (``idx`` is then a list); ``None`` calls it per
            item; ``"shard"`` (:data:`WHOLE_SHARD`) calls it once with all of the shard's items.
        output_dir: Local path or fsspec URL (``s3://bucket/prefix``) for shard and merged
            outputs. ``None`` runs in a temporary directory, removed after ``merge`` (nothing resumes).
        shard_subdir: Sub-directory of ``output_dir`` holding the ``split.*`` directories.
        resume: Skip shards whose ``done`` record carries the current shard hash; ``False``
            recomputes every shard.
        fingerprint: ESPnet3's identity of the run's configuration and inputs (JSON-able):
            hashed into every shard, so a changed fingerprint recomputes (ESPnet3 refuses to resume).
        shard_size: Mean items per shard (content-defined: between half and twice that). Fewer
            items than ``2 × workers × shard_size`` on a cluster are cut finer, 2 to 4 shards per
            worker (:func:`~espnet3_flows.sharding.split_shard_size`).
        storage_options: fsspec options for ``output_dir`` (credentials, endpoint).
        on_error: ``fail`` raises on the first bad item; ``skip`` records it and goes on.
        staging_dir: Local directory for shard staging (the system's temporary directory by default).
    """

    #: Exceptions from ``forward`` that mean "this item is bad" (subject to ``on_error``);
    #: anything else (storage, network) fails the shard so it can be retried.
    item_errors: tuple[type[BaseException], ...] = (BadItemError,)
    #: With a remote ``output_dir``, ``merge`` receives local copies of the completed shard
    #: directories (``output_dir`` is then a local directory whose new files are published to the
    #: remote one when ``merge`` returns). A runner that reads remote shard directories itself
    #: sets this to ``False`` and receives their URLs.
    download_shards_for_merge: bool = True
    #: Modules a worker imports to build this runner's resources and run its items, beyond the
    #: runner's and its provider's own modules (e.g. a model's package). Optional: forked local
    #: workers import them once, in their forkserver, before any shard starts
    #: (:mod:`~espnet3_flows.parallel.forkserver`); nothing breaks when one is missing here.
    worker_modules: tuple[str, ...] = ()

    def __init__(self, provider: Any, batch_size: int | str | None = None, output_dir: str | Path | None = None,
                 shard_subdir: str = "", resume: bool = True, fingerprint: Any = None, *, shard_size: int = 256,
                 storage_options: Mapping[str, Any] | None = None, on_error: str = "fail",
                 staging_dir: str | None = None):
        check_on_error(on_error)
        if batch_size is not None and batch_size != WHOLE_SHARD and (
                isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer, None or {WHOLE_SHARD!r}, got {batch_size!r}")
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self.provider = provider
        self.batch_size = batch_size
        self.output_dir: Path | str | None = None
        self.set_output_dir(output_dir)
        self.shard_subdir = (shard_subdir or "").strip("/")
        self.resume = resume
        self.fingerprint = fingerprint
        self.shard_size = shard_size
        self.storage_options = dict(storage_options or {})
        self.on_error = on_error
        self.staging_dir = staging_dir
        #: This run's shards, in plan order, set by the engine before ``merge`` (counts for a summary)
        self.run_shards: list[ShardStatus] = []
        self._done_memo: dict[str, ShardResult] = {}

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        _keep_earlier_hook_names(cls)

    def set_output_dir(self, output_dir: str | Path | None) -> None:
        """Set ``output_dir``: a ``Path`` for a local path (as in ESPnet3), the URL for a remote one."""
        if output_dir is None:
            self.output_dir = None
        else:
            text = str(output_dir)
            self.output_dir = Path(fsspec.core.strip_protocol(text)) if is_local_url(text) else text

    # ---- ESPnet3's hooks (override) -----------------------------------------------------
    @staticmethod
    def forward(idx: Any, **resources: Any) -> Any:
        """Process one item, or the list of a batch; the parameters after ``idx`` name resources."""
        raise NotImplementedError

    @staticmethod
    def open_writers(shard_dir: Path | None, **resources: Any) -> dict[str, Any]:
        """Open the shard's writers (files in ``shard_dir``); ESPnet3's default opens none."""
        return {}

    @staticmethod
    def write_record(writers: dict[str, Any], result: Any, state: dict[str, Any], **resources: Any) -> None:
        """Persist one ``forward`` result; ESPnet3's default appends it to ``state["records"]``."""
        state.setdefault("records", []).append(result)

    @staticmethod
    def close_writers(writers: dict[str, Any], state: dict[str, Any] | None = None,
                      **resources: Any) -> dict[str, Any] | None:
        """Close the shard's writers (every value with a ``close()``); a dict returned is merged
        into the shard's state."""
        for writer in writers.values():
            close = getattr(writer, "close", None)
            if callable(close):
                close()
        return None

    @classmethod
    def init_state(cls, shard_id: Any = 0, output_dir: str = "", shard_subdir: str = "",
                   shard_name: str | None = None, **resources: Any) -> dict[str, Any]:
        """A shard's initial state; creates its directory and opens its writers there.

        Args:
            shard_id: The shard's position in the plan.
            output_dir: The output location the hooks write to (a local staging directory).
            shard_subdir: The runner's ``shard_subdir``.
            shard_name: The shard's directory name (``split.<hash>``; ESPnet3's
                ``split.<shard_id>`` when not given).
            **resources: The shard's resources, passed on to ``open_writers``.
        """
        shard_dir = Path(output_dir) / (shard_subdir or "") / (shard_name or f"split.{shard_id}")
        shard_dir.mkdir(parents=True, exist_ok=True)
        writers = call_with_resources(cls.open_writers, shard_dir, shard_id=shard_id, output_dir=output_dir,
                                      shard_subdir=shard_subdir, **resources)
        return {"shard_id": shard_id, "shard_dir": str(shard_dir), "_writers": writers, "records": []}

    @classmethod
    def reduce_state(cls, state: dict[str, Any], result: Any, **resources: Any) -> dict[str, Any]:
        """Fold one ``forward`` result into the state (through ``write_record``)."""
        call_with_resources(cls.write_record, state["_writers"], result, state, **resources)
        return state

    @classmethod
    def finalize_state(cls, state: dict[str, Any], **resources: Any) -> dict[str, Any]:
        """Close the writers (``close_writers``), merge what it returns into the state, drop the writers."""
        meta = call_with_resources(cls.close_writers, state.get("_writers", {}), state, **resources)
        if meta:
            state.update(meta)
        state.pop("_writers", None)
        return state

    def merge(self, shard_dirs: list[Path]) -> Any:
        """Combine the completed shards (their directories, in plan order) into the run's result.

        The default returns the ``records`` of every shard in order: what ``forward`` returned
        for each item or batch, when the default ``write_record`` kept them (ESPnet3's own
        default returns ``None``). Runners with writers override this and read their files.
        """
        out: list[Any] = []
        for shard_dir in shard_dirs:
            out.extend(self.read_records(shard_dir))
        return out

    def __call__(self, indices: Sequence[Any]) -> Any:
        """ESPnet3's entry point: run over ``indices`` and return what ``merge`` returns."""
        return self.run(indices).merged

    # ---- what else a runner may define (ours) -------------------------------------------
    def item_keys(self, items: Sequence[Any]) -> list[str]:
        """Identity and fingerprint of each item, hashed into its shard (default: the item itself)."""
        return [runner_item_key(i) for i in items]

    def hash_config(self) -> Mapping[str, Any]:
        """The part of the job config that changes outputs (hashed into every shard)."""
        cls = type(self)
        config: dict[str, Any] = {"runner": f"{cls.__module__}.{cls.__qualname__}", "batch_size": self.batch_size}
        if self.fingerprint is not None:
            config["fingerprint"] = self.fingerprint
        return config

    def shard_resources(self, shard: Shard, resources: Mapping[str, Any]) -> Mapping[str, Any]:
        """The resources the hooks see for one shard: the worker's resources plus per-shard parts
        (default: unchanged). Jobs whose items live in a manifest add the shard's items here, so a
        worker holds one shard's items, never the split's."""
        return resources

    def shard_resource_keys(self) -> tuple[str, ...]:
        """Keys :meth:`shard_resources` adds (checked against ``forward`` with the provider's keys)."""
        return ()

    def describe_item(self, idx: Any, resources: Mapping[str, Any]) -> str:
        """A human-readable location of an item for error messages."""
        return f"item {idx!r}"

    def skip_record(self, idx: Any, resources: Mapping[str, Any], exc: BaseException) -> dict[str, Any]:
        """The JSON record of an item skipped under ``on_error: skip``."""
        return {"idx": idx, "reason": f"{type(exc).__name__}: {exc}"}

    # ---- storage and shard directories ---------------------------------------------------
    @property
    def storage(self) -> Storage | None:
        """The output storage, or ``None`` before a run gives a runner without ``output_dir`` one."""
        return None if self.output_dir is None else Storage(str(self.output_dir), self.storage_options)

    def shard_rel(self, shard: Shard | ShardStatus, *parts: str) -> str:
        """Path of a shard's file relative to ``output_dir``."""
        return posixpath.join(*(p for p in (self.shard_subdir, shard.name, *parts) if p))

    def shard_location(self, shard: Shard | ShardStatus) -> Path | str:
        """A shard's directory: a ``Path`` for a local output, else its URL."""
        store = self.storage
        assert store is not None
        uri = store.uri(self.shard_rel(shard))
        return Path(uri) if store.is_local else uri

    # ---- planning and checks ----------------------------------------------------------
    def plan(self, indices: Sequence[Any] | None, workers: int = 1) -> ShardPlan:
        """The shard plan for ``indices`` (content-addressed; see :func:`plan_shards`), cut finer
        than ``shard_size`` when the items are too few to keep ``workers`` concurrent workers busy
        (:func:`~espnet3_flows.sharding.split_shard_size`)."""
        if indices is None:
            raise TypeError(f"{type(self).__name__}.run() needs the item indices, e.g. runner(range(n))")
        items = [plan_item(i, pos) for pos, i in enumerate(indices)]
        size = split_shard_size(self.shard_size, len(items), workers)
        return plan_shards(self.item_keys(items), size, self.hash_config(), indices=items)

    def check_resource_keys(self, keys: Sequence[str]) -> None:
        """Raise :class:`ProviderError` if ``forward`` needs a key the resources lack."""
        keys = [*keys, *self.shard_resource_keys(), "output_dir", "shard_subdir"]
        missing = missing_keys(self.forward, keys, 1)
        if missing:
            raise ProviderError(
                f"{type(self).__name__}.forward needs {missing} but {type(self.provider).__name__} "
                f"provides only {sorted(set(keys) - {'output_dir', 'shard_subdir'})}; add them to its resources or "
                "rename the parameters")

    # the hooks' earlier names (:data:`EARLIER_HOOK_NAMES`): the same methods
    shard_env = shard_resources
    shard_env_keys = shard_resource_keys
    check_env_keys = check_resource_keys

    def write_plan(self, plan: ShardPlan) -> None:
        """Publish the plan as ``manifest.json`` beside the shard directories (atomically)."""
        store = self.storage
        if store is not None:
            store.write_json(posixpath.join(self.shard_subdir, PLAN) if self.shard_subdir else PLAN,
                             plan.to_dict())

    def run_shard(self, shard: Shard, resources: Mapping[str, Any], run_id: str = "") -> ShardResult:
        """Compute one shard with the worker's ``resources`` and publish it (see :mod:`.shard_lifecycle`)."""
        return run_shard(self, shard, resources, run_id)

    # ---- a whole run --------------------------------------------------------------------
    @contextlib.contextmanager
    def output_scope(self) -> Iterator[None]:
        """The run's output location: ``output_dir``, or a temporary local directory for a runner
        without one (removed when the block ends)."""
        if self.output_dir is not None:
            yield
            return
        tmp = tempfile.mkdtemp(prefix=f"espnet3-{type(self).__name__}-")
        self.set_output_dir(tmp)
        try:
            yield
        finally:
            self.output_dir = None
            shutil.rmtree(tmp, ignore_errors=True)

    def run(self, indices: Sequence[Any] | None = None, client: Any = None, parallel: Any = None,
            progress: bool = True) -> RunOutcome:
        """Plan, skip finished shards, compute the rest (in this process or on Dask), merge.

        Args:
            indices: The items (``None`` for runners that plan from their own input, such as a manifest).
            client: A ``distributed.Client``; shards run on its cluster.
            parallel: Without a client, a ``parallel`` config (mapping or
                :class:`~.parallel_config.ParallelConfig`) to start a cluster for this run;
                ``set_parallel``'s config by default; ``serial``, or none set, runs in this process.
            progress: Show a progress bar.
        """
        from espnet3_flows.parallel.scheduler import (
            engine_executor,
            plan_runner,
            planning_workers,
            run_parallel_config,
            run_planned,
        )

        refuse_while_importing_main("a run")  # an unguarded script, imported by Dask's workers: one error line
        t0 = time.perf_counter()
        with self.output_scope():
            cfg = None if client is not None else run_parallel_config(parallel)  # read once, for both
            planned = plan_runner(self, indices, workers=planning_workers(client, cfg))
            with engine_executor(planned, client, cfg) as executor:
                merged = run_planned([planned], executor, progress=progress)[0]
        return RunOutcome(planned.plan, planned.statuses, merged, time.perf_counter() - t0)


def concatenate_shard_files(shard_dirs: Sequence[Path | str], relative_name: str, out_path: Path | str) -> bool:
    """Concatenate each shard's ``relative_name`` (in the order given, missing ones skipped) into
    ``out_path``, as ESPnet3's helper of the same name; ``False`` (and no file) when no shard has one."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    found = False
    with out.open("wb") as dest:
        for shard_dir in shard_dirs:
            part = Path(shard_dir) / relative_name
            if part.is_file():
                found = True
                with part.open("rb") as src:
                    shutil.copyfileobj(src, dest)
    if not found:
        out.unlink(missing_ok=True)
    return found
