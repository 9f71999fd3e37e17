"""BaseRunner: ESPnet3's runner with content-addressed shards, a per-shard sink, publish-then-done and resume."""

from __future__ import annotations

import inspect
import logging
import posixpath
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from espnet3_flows.errors import BadItemError, Espnet3FlowsError
from espnet3_flows.manifest import ON_ERROR_POLICIES
from espnet3_flows.parallel.cluster import ParallelConfig, get_client, get_parallel_config, parallel_is_set
from espnet3_flows.parallel.provider import EnvironmentProvider, ProviderError
from espnet3_flows.parallel.worker_env import env_keys, get_env, plugin_for
from espnet3_flows.parallel.results import RunOutcome, ShardResult
from espnet3_flows.parallel.sink import ShardSink
from espnet3_flows.sharding import Shard, ShardPlan, plan_shards, shard_name
from espnet3_flows.storage import Storage

log = logging.getLogger(__name__)

DONE = "done"
PLAN = "manifest.json"


class ItemError(Espnet3FlowsError, RuntimeError):
    """``forward`` failed on an item under ``on_error: fail``; the message names the item."""


class ShardFailure(Espnet3FlowsError, RuntimeError):
    """One or more shards failed; the others finished and were published."""


#: ``batch_size`` value for one ``forward`` call with all of a shard's items (a job that batches
#: within the shard itself, e.g. length-sorted model batches)
WHOLE_SHARD = "shard"


def _chunks(seq: Sequence[int], size: int | str | None) -> list[int | list[int]]:
    if size == WHOLE_SHARD:
        return [list(seq)] if len(seq) else []
    if not size:
        return list(seq)
    return [list(seq[i:i + size]) for i in range(0, len(seq), size)]


class BaseRunner:
    """Runs ``forward`` over items, shard by shard, with ESPnet3's hooks and names.

    Subclasses define ``forward`` as a ``@staticmethod`` whose first parameter is the item
    index (an ``int``, or a ``list[int]`` when ``batch_size`` is set) and whose other
    parameters are env keys, injected by name. Each shard: ``open_sink`` and ``init_state`` →
    for each item or batch ``forward`` → ``sink.add`` and ``reduce_state`` → ``sink.finish`` →
    ``finalize_state`` → its files published → ``done``. A run ends with :meth:`publish`: the
    merged result (:meth:`merge`) and, for jobs that have them, the split's final files.

    Args:
        provider: Builds the env (model, dataset) once per process or worker.
        batch_size: Items per ``forward`` call; ``None`` calls it per item; ``"shard"``
            (:data:`WHOLE_SHARD`) calls it once with all of the shard's items.
        output_dir: Local path or fsspec URL for shard and merged outputs; ``None`` keeps
            results in memory (no resume).
        shard_subdir: Sub-directory of ``output_dir`` holding ``split.N`` directories.
        resume: Skip shards whose ``done`` record carries the current shard hash.
        shard_size: Items per shard.
        storage_options: fsspec options for ``output_dir`` (credentials, endpoint).
        on_error: ``fail`` raises on the first bad item; ``skip`` records it and goes on.
        staging_dir: Local directory for shard staging (system temp by default).
    """

    #: Exceptions from ``forward`` that mean "this item is bad" (subject to ``on_error``);
    #: anything else (storage, network) fails the shard so it can be retried.
    item_errors: tuple[type[BaseException], ...] = (BadItemError,)

    def __init__(self, provider: EnvironmentProvider, *, batch_size: int | str | None = None,
                 output_dir: str | None = None, shard_subdir: str = "", resume: bool = True,
                 shard_size: int = 256, storage_options: Mapping[str, Any] | None = None,
                 on_error: str = "fail", staging_dir: str | None = None):
        if on_error not in ON_ERROR_POLICIES:
            raise ValueError(f"on_error must be one of {ON_ERROR_POLICIES}, got {on_error!r}")
        if batch_size is not None and batch_size != WHOLE_SHARD and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be >= 1, None or {WHOLE_SHARD!r}, got {batch_size!r}")
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self.provider = provider
        self.batch_size = batch_size
        self.output_dir = None if output_dir is None else str(output_dir)
        self.shard_subdir = shard_subdir.strip("/")
        self.resume = resume
        self.shard_size = shard_size
        self.storage_options = dict(storage_options or {})
        self.on_error = on_error
        self.staging_dir = staging_dir

    # ---- the job's parts (override) -----------------------------------------------------
    @staticmethod
    def forward(idx: Any, **env: Any) -> Any:
        """Process one item (or a list of items); parameters after ``idx`` are env keys."""
        raise NotImplementedError

    def item_keys(self, indices: Sequence[int]) -> list[str]:
        """Identity and fingerprint of each item, hashed into its shard (default: the index)."""
        return [str(i) for i in indices]

    def hash_config(self) -> Mapping[str, Any]:
        """The part of the job config that changes outputs (hashed into every shard)."""
        return {"runner": f"{type(self).__module__}.{type(self).__qualname__}", "batch_size": self.batch_size}

    def shard_env(self, shard: Shard, env: Mapping[str, Any]) -> Mapping[str, Any]:
        """The env ``forward`` sees for one shard: the worker's env plus per-shard parts (default:
        unchanged). Jobs whose items live in a manifest add the shard's items here, so a worker
        holds one shard's items, never the split's."""
        return env

    def shard_env_keys(self) -> tuple[str, ...]:
        """Keys :meth:`shard_env` adds (checked against ``forward`` with the provider's keys)."""
        return ()

    def describe_item(self, idx: int, env: Mapping[str, Any]) -> str:
        """A human-readable location of an item for error messages."""
        return f"item {idx}"

    def skip_record(self, idx: int, env: Mapping[str, Any], exc: BaseException) -> dict[str, Any]:
        """The JSON record of an item skipped under ``on_error: skip``."""
        return {"idx": int(idx), "reason": f"{type(exc).__name__}: {exc}"}

    def open_sink(self, staging: Path, shard: Shard) -> ShardSink | None:
        """The writer of ``shard``'s files on its local staging directory (default: none, the
        shard writes no files); see :class:`~espnet3_flows.parallel.sink.ShardSink`."""
        return None

    def init_state(self) -> Any:
        """The initial accumulator state of a shard."""
        return []

    def reduce_state(self, state: Any, result: Any) -> Any:
        """Fold one ``forward`` result into the state."""
        state.append(result)
        return state

    def finalize_state(self, state: Any) -> Any:
        """The shard's JSON-able result (stored in ``done``; never pickle)."""
        return state

    def merge(self, results: list[ShardResult]) -> Any:
        """Combine shard results (in shard order) into the run's result; no side effects."""
        out: list[Any] = []
        for r in results:
            out.extend(r.result if isinstance(r.result, list) else [r.result])
        return out

    def publish(self, results: list[ShardResult]) -> Any:
        """The run's last step, once every shard is done: write the merged outputs (default:
        none) and return the run's result (default: :meth:`merge`). Jobs with final files
        override this; it must be safe to repeat (a rerun with nothing new publishes again)."""
        return self.merge(results)

    # ---- storage ----------------------------------------------------------------------
    @property
    def storage(self) -> Storage | None:
        """The output storage, or ``None`` for in-memory runs."""
        return None if self.output_dir is None else Storage(self.output_dir, self.storage_options)

    def shard_rel(self, shard: Shard, *parts: str) -> str:
        """Path of a shard's file relative to ``output_dir``."""
        return posixpath.join(*(p for p in (self.shard_subdir, shard.name, *parts) if p))

    def load_done(self, shard: Shard) -> ShardResult | None:
        """The shard's ``done`` record if it matches the current shard hash."""
        if not self.resume:
            return None
        return self.read_done(shard.hash, cached=True)

    def read_done(self, shard_hash: str, cached: bool = False) -> ShardResult | None:
        """The ``done`` record of the shard with ``shard_hash``, if one exists (resume or not)."""
        store = self.storage
        if store is None:
            return None
        rec = store.read_json(posixpath.join(self.shard_subdir, shard_name(shard_hash), DONE))
        if not rec or rec.get("shard_hash") != shard_hash:
            return None
        return ShardResult.from_dict(rec, cached=cached)

    # ---- planning and checks ----------------------------------------------------------
    def plan(self, indices: Sequence[int] | None) -> ShardPlan:
        """The shard plan for ``indices`` (content-addressed; see :func:`plan_shards`)."""
        if indices is None:
            raise TypeError(f"{type(self).__name__}.run() needs the item indices, e.g. runner.run(range(n))")
        indices = [int(i) for i in indices]
        return plan_shards(self.item_keys(indices), self.shard_size, self.hash_config(), indices=indices)

    def check_env_keys(self, keys: Sequence[str]) -> None:
        """Raise :class:`ProviderError` if ``forward`` needs a key the env lacks."""
        keys = [*keys, *self.shard_env_keys()]
        sig = inspect.signature(self.forward)
        params = list(sig.parameters.values())[1:]
        if any(p.kind == p.VAR_KEYWORD for p in params):
            return
        missing = [p.name for p in params if p.default is p.empty and p.name not in keys
                   and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if missing:
            raise ProviderError(
                f"{type(self).__name__}.forward needs {missing} but {type(self.provider).__name__} "
                f"provides only {sorted(keys)}; add them to the env or rename the parameters")

    def _forward_kwargs(self, env: Mapping[str, Any]) -> dict[str, Any]:
        params = list(inspect.signature(self.forward).parameters.values())[1:]
        if any(p.kind == p.VAR_KEYWORD for p in params):
            return dict(env)
        return {p.name: env[p.name] for p in params if p.name in env}

    # ---- one shard ----------------------------------------------------------------------
    def run_shard(self, shard: Shard, env: Mapping[str, Any]) -> ShardResult:
        """Compute one shard and publish it: files first, the ``done`` record last.

        ``files`` of the result lists the published files the sink lists
        (:meth:`~espnet3_flows.parallel.sink.ShardSink.listed`); the others (e.g. one file per
        utterance) are only counted, so done records stay small.
        """
        env = self.shard_env(shard, env)
        self.check_env_keys(list(env))
        kwargs = self._forward_kwargs(env)
        t0 = time.perf_counter()
        staging = Path(tempfile.mkdtemp(prefix=f"espnet3-{shard.name}-", dir=self.staging_dir))
        try:
            sink = self.open_sink(staging, shard)
            state = self.init_state()
            skipped: list[dict[str, Any]] = []
            for chunk in _chunks(shard.items, self.batch_size):
                for idx, out in self._forward_checked(chunk, kwargs, env, skipped):
                    if sink is not None:
                        sink.add(idx, out)
                    state = self.reduce_state(state, out)
            if sink is not None:
                sink.finish()
            result = self.finalize_state(state)
            seconds = time.perf_counter() - t0
            store = self.storage
            files: list[str] = []
            res = ShardResult(shard, result, files, skipped, False, seconds)
            if store is not None:
                store.remove(self.shard_rel(shard, DONE))
                for name in sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file()):
                    rel = (sink.destination(name) if sink is not None else None) or self.shard_rel(shard, name)
                    store.publish_file(staging / name, rel)
                    if sink is None or sink.listed(name):
                        files.append(rel)
                    else:
                        res.published_elsewhere += 1
                store.write_json(self.shard_rel(shard, DONE), res.to_dict())
            return res
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _forward_checked(self, chunk: int | list[int], kwargs: dict[str, Any], env: Mapping[str, Any],
                         skipped: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
        try:
            return [(chunk, self.forward(chunk, **kwargs))]
        except self.item_errors as exc:
            if isinstance(chunk, list) and len(chunk) > 1:
                # find the bad item(s): rerun the batch item by item
                kept = [i for i in chunk if not self._try_item([i], kwargs, env, skipped)]
                if not kept:
                    return []
                return [(kept, self.forward(kept, **kwargs))]
            first = chunk[0] if isinstance(chunk, list) else chunk
            if self.on_error == "skip":
                skipped.append(self.skip_record(first, env, exc))
                return []
            raise ItemError(f"{self.describe_item(first, env)}: {exc}") from exc

    def _try_item(self, item: list[int], kwargs: dict[str, Any], env: Mapping[str, Any],
                  skipped: list[dict[str, Any]]) -> bool:
        """True when the item fails (and is skipped or raised per policy)."""
        try:
            self.forward(item, **kwargs)
            return False
        except self.item_errors as exc:
            if self.on_error == "skip":
                skipped.append(self.skip_record(item[0], env, exc))
                return True
            raise ItemError(f"{self.describe_item(item[0], env)}: {exc}") from exc

    # ---- a whole run --------------------------------------------------------------------
    def collect_done(self, plan: ShardPlan) -> dict[int, ShardResult]:
        """``done`` records of the plan's shards that match (read concurrently)."""
        if self.storage is None or not self.resume:
            return {}
        with ThreadPoolExecutor(max_workers=16) as pool:
            found = list(pool.map(self.load_done, plan.shards))
        return {s.index: r for s, r in zip(plan.shards, found) if r is not None}

    def write_plan(self, plan: ShardPlan) -> None:
        """Publish the plan as ``manifest.json`` beside the shard directories (atomically)."""
        store = self.storage
        if store is not None:
            store.write_json(posixpath.join(self.shard_subdir, PLAN) if self.shard_subdir else PLAN,
                             plan.to_dict())

    def run(self, indices: Sequence[int] | None = None, client: Any = None, parallel: ParallelConfig | None = None,
            progress: bool = True, on_shard: Callable[[ShardResult], None] | None = None) -> RunOutcome:
        """Plan, skip finished shards, compute the rest (in-process or on Dask), publish.

        Args:
            indices: Item indices (``None`` for jobs that plan from their own input, such as
                a manifest).
            client: A ``distributed.Client``; shards run there.
            parallel: Without a client, a config to start a cluster for this run
                (``set_parallel``'s config by default; ``serial`` or none runs in-process).
            progress: Show a progress bar.
            on_shard: Called with each shard result as it finishes (cached ones first).
        """
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        plan = self.plan(indices)
        self.write_plan(plan)
        results = self.collect_done(plan)
        for r in results.values():
            if on_shard:
                on_shard(r)
        pending = [s for s in plan.shards if s.index not in results]
        bar = tqdm(total=len(plan.shards), initial=len(results), desc=type(self).__name__,
                   unit="shard", disable=not progress or not pending)
        try:
            cfg = parallel if parallel is not None else (get_parallel_config() if parallel_is_set() else None)
            if pending and client is None and cfg is not None and cfg.env != "serial":
                with get_client(plugin_for(self.provider), cfg) as own_client:
                    self._run_pending(pending, own_client, results, bar, on_shard)
            elif pending:
                self._run_pending(pending, client, results, bar, on_shard)
        finally:
            bar.close()
        ordered = [results[s.index] for s in plan.shards]
        merged = self.publish(ordered)
        return RunOutcome(plan, ordered, merged, time.perf_counter() - t0)

    def __call__(self, indices: Sequence[int]) -> Any:
        """ESPnet3's entry point: run over ``indices`` and return the merged (published) result."""
        return self.run(indices).merged

    def _run_pending(self, pending: list[Shard], client: Any, results: dict[int, ShardResult],
                     bar: Any, on_shard: Callable[[ShardResult], None] | None) -> None:
        if client is None:
            env = get_env(self.provider, local=True)
            self.check_env_keys(list(env))
            for shard in pending:
                res = self.run_shard(shard, env)
                results[shard.index] = res
                bar.update(1)
                if on_shard:
                    on_shard(res)
            return
        from distributed import as_completed

        store = self.storage
        if store is not None and store.fs.protocol in ("memory", ("memory",)):
            raise ValueError(f"output_dir {self.output_dir!r} is in this process's memory; Dask workers in "
                             "other processes cannot write there: use a path or an object store URL")
        self.provider.checked_setup_fn()
        for keys in client.run(_remote_env_keys, self.provider).values():
            self.check_env_keys(keys)
        futures = {client.submit(run_shard_on_worker, self, shard, key=f"{shard.name}-{shard.hash[:12]}",
                                 pure=False): shard for shard in pending}
        errors: list[tuple[Shard, BaseException]] = []
        for fut in as_completed(futures):
            shard = futures[fut]
            if fut.status == "error":
                errors.append((shard, fut.exception()))
                continue
            res = ShardResult.from_dict(fut.result())
            res.cached = False
            results[shard.index] = res
            bar.update(1)
            if on_shard:
                on_shard(res)
        if errors:
            shard, exc = errors[0]
            names = ", ".join(s.name for s, _ in errors)
            raise ShardFailure(f"{len(errors)} shard(s) failed ({names}); the others are published "
                               f"and a rerun resumes. First error in {shard.name}: {exc}") from exc


def _remote_env_keys(provider: EnvironmentProvider) -> list[str]:
    return env_keys(provider)


def run_shard_on_worker(runner: BaseRunner, shard: Shard) -> dict[str, Any]:
    """Run one shard with this worker's env (built once per worker); returns the ``done`` record."""
    return runner.run_shard(shard, get_env(runner.provider)).to_dict()
