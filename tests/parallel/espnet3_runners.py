"""Providers and runners written only against ESPnet3's documented API (``espnet3.parallel``), with
the imports changed to ``espnet3_flows.parallel``: nothing here uses what this project adds.
Importable by Dask workers."""

from __future__ import annotations

import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np

from espnet3_flows.parallel.base_runner import BaseRunner, concatenate_shard_files
from espnet3_flows.parallel.env_provider import EnvironmentProvider


def _double(x):
    return 2 * x



def _write_shapes(writers, key, uid2shape):
    """ESPnet3's collect-stats shape rows: ``<uid> <shape>`` per utterance into the shard's
    ``{key}_shape`` file, opened on first use."""
    handle = writers["shape_handles"].get(key)
    if handle is None:
        handle = writers["shape_handles"][key] = (writers["_shard_dir"] / f"{key}_shape").open("w")
    for uid, shape in uid2shape.items():
        handle.write(f"{uid} {shape}\n")


class ListProvider(EnvironmentProvider):
    """``dataset``: ``config["n"]`` numbers; ``model``: doubles them (the provider/runner page's example)."""

    def build_env_local(self):
        return {"dataset": list(range(self.config["n"])), "model": _double}

    def build_worker_setup_fn(self):
        n = self.config["n"]

        def setup():
            return {"dataset": list(range(n)), "model": _double}

        return setup


class DuckProvider:
    """A provider that does not derive from EnvironmentProvider (ESPnet3's runner only calls the two methods)."""

    def __init__(self, n):
        self.n = n

    def build_env_local(self):
        return {"dataset": list(range(self.n)), "model": _double}

    def build_worker_setup_fn(self):
        n = self.n
        return lambda: {"dataset": list(range(n)), "model": _double}


class RecordsRunner(BaseRunner):
    """Only ``forward``: the x-vector page's "Adapting for a new task" shape."""

    @staticmethod
    def forward(idx, dataset, model, **env):
        if isinstance(idx, int):
            return {"idx": idx, "y": model(dataset[idx])}
        return [{"idx": i, "y": model(dataset[i])} for i in idx]


class FailsOn13Runner(RecordsRunner):
    """``forward`` raises on item 13 (a bug in a model, not a bad item)."""

    @staticmethod
    def forward(idx, dataset, model, **env):
        if idx == 13:
            raise RuntimeError("model exploded on 13")
        return idx


class HookLogRunner(BaseRunner):
    """Every writer hook logs its call in the shard's ``hooks.log``; results go to ``rows.txt``;
    ``merge`` reports the shard directories it got, in order, and concatenates the rows."""

    @staticmethod
    def forward(idx, dataset, model, **env):
        ids = idx if isinstance(idx, list) else [idx]
        return [(i, model(dataset[i])) for i in ids]

    @staticmethod
    def open_writers(shard_dir, shard_id=0, output_dir="", shard_subdir="", **env):
        shard_dir = Path(shard_dir)
        log = open(shard_dir / "hooks.log", "w")  # noqa: SIM115 - a writer ESPnet3 closes in close_writers
        log.write(f"open {shard_id} {shard_dir.name} {Path(shard_dir).is_relative_to(Path(output_dir))}\n")
        (shard_dir / "token").write_text(uuid.uuid4().hex)  # a fresh one each time the shard is computed
        return {"log": log, "rows": open(shard_dir / "rows.txt", "w")}

    @staticmethod
    def write_record(writers, result, state, **env):
        writers["log"].write(f"record {len(result)}\n")
        for i, y in result:
            writers["rows"].write(f"{i} {y}\n")
        state["n"] = state.get("n", 0) + len(result)

    @staticmethod
    def close_writers(writers, state, **env):
        writers["log"].write("close\n")
        for w in writers.values():
            w.close()
        return {"closed": True}

    def merge(self, shard_dirs):
        out = Path(self.output_dir) / "rows.txt"
        concatenate_shard_files(shard_dirs, "rows.txt", out)
        return {"dirs": [str(d) for d in shard_dirs],
                "logs": [(Path(d) / "hooks.log").read_text().splitlines() for d in shard_dirs],
                "tokens": [(Path(d) / "token").read_text() for d in shard_dirs],
                "done": [self.is_shard_done(d) for d in shard_dirs],
                "rows": out.read_text().splitlines(), "merged_file": out}


class OneArgCloseRunner(HookLogRunner):
    """The older provider/runner page's ``close_writers(writers)``."""

    @staticmethod
    def close_writers(writers):
        for w in writers.values():
            w.close()


class RequiresMarkerRunner(HookLogRunner):
    """A runner whose ``is_shard_done`` also wants a file of its own."""

    @classmethod
    def is_shard_done(cls, shard_dir):
        return super().is_shard_done(shard_dir) and (Path(shard_dir) / "rows.txt").stat().st_size > 0


# ---- collect-stats as ESPnet3's CollectStatsRunner does it -------------------------------------
class FbankModel:
    """``collect_feats`` over a padded batch, as an ESPnet model's: ``{"feats", "feats_lengths"}``."""

    def __init__(self):
        from espnet3_flows.frontends.frontend import FrontendConfig, build_frontend

        self.frontend = build_frontend(FrontendConfig())

    def collect_feats(self, speech, speech_lengths):
        feats = self.frontend([s[:n] for s, n in zip(speech, speech_lengths, strict=True)], {})
        lengths = np.array([f.shape[0] for f in feats])
        padded = np.zeros((len(feats), lengths.max(), feats[0].shape[1]), dtype=np.float64)
        for k, f in enumerate(feats):
            padded[k, :len(f)] = f
        return {"feats": padded, "feats_lengths": lengths}


class WavListProvider(EnvironmentProvider):
    """``dataset``: ``(utt_id, path)`` of a TSV manifest; ``model``: :class:`FbankModel`."""

    def build_env_local(self):
        return self.build_worker_setup_fn()()

    def build_worker_setup_fn(self):
        manifest = self.config["manifest"]

        def setup():
            rows = [line.split("\t")[:2] for line in Path(manifest).read_text().splitlines() if line.strip()]
            return {"dataset": rows, "model": FbankModel()}

        return setup


class Espnet3CollectStatsRunner(BaseRunner):
    """Per shard ``{key}_stats.npz`` and ``{key}_shape`` written in ``close_writers``; ``merge`` sums
    the shards' statistics and concatenates their shapes under ``output_dir/<mode>``."""

    def __init__(self, provider, output_dir, mode, **kwargs):
        super().__init__(provider, output_dir=output_dir, shard_subdir=mode, **kwargs)
        self.mode = mode

    @staticmethod
    def forward(batch_indices, dataset, model, **env):
        import soundfile as sf

        ids = list(batch_indices) if isinstance(batch_indices, list) else [batch_indices]
        uids, speech = [], []
        for i in ids:
            uid, path = dataset[i]
            uids.append(uid)
            speech.append(sf.read(path, dtype="float32")[0])
        lengths = [len(s) for s in speech]
        batch = np.zeros((len(speech), max(lengths)), dtype=np.float32)
        for k, s in enumerate(speech):
            batch[k, :len(s)] = s
        feats = model.collect_feats(speech=batch, speech_lengths=lengths)
        stats = defaultdict(lambda: {"sum": 0, "sq": 0, "count": 0})
        shapes = defaultdict(dict)
        for b, uid in enumerate(uids):
            seq = feats["feats"][b][:int(feats["feats_lengths"][b])]
            stats["feats"]["sum"] += seq.sum(0)
            stats["feats"]["sq"] += (seq ** 2).sum(0)
            stats["feats"]["count"] += len(seq)
            shapes["feats"][uid] = ",".join(map(str, seq.shape))
        return dict(stats), dict(shapes)

    @staticmethod
    def open_writers(shard_dir, **env):
        return {"_shard_dir": Path(shard_dir), "shape_handles": {}}

    @staticmethod
    def write_record(writers, result, state, **env):
        stats, shapes = result
        sums = state.setdefault("sum", defaultdict(float))
        squares = state.setdefault("sq", defaultdict(float))
        counts = state.setdefault("count", defaultdict(int))
        for key, agg in stats.items():
            sums[key] += agg["sum"]
            squares[key] += agg["sq"]
            counts[key] += agg["count"]
        for key, uid2shape in shapes.items():
            _write_shapes(writers, key, uid2shape)

    @staticmethod
    def close_writers(writers, state, **env):
        shard_dir = writers["_shard_dir"]
        for handle in writers["shape_handles"].values():
            handle.close()
        keys = sorted(state.get("sum", {}))
        (shard_dir / "stats_keys.txt").write_text("".join(f"{k}\n" for k in keys))
        (shard_dir / "shape_keys.txt").write_text("".join(f"{k}\n" for k in sorted(writers["shape_handles"])))
        for key in keys:
            np.savez(shard_dir / f"{key}_stats.npz", count=state["count"][key], sum=state["sum"][key],
                     sum_square=state["sq"][key])

    def merge(self, shard_dirs):
        sums, squares, counts, shape_keys = defaultdict(float), defaultdict(float), defaultdict(int), set()
        for shard_dir in shard_dirs:
            shape_keys.update((shard_dir / "shape_keys.txt").read_text().split())
            for key in (shard_dir / "stats_keys.txt").read_text().split():
                with np.load(shard_dir / f"{key}_stats.npz") as data:
                    sums[key] += data["sum"]
                    squares[key] += data["sum_square"]
                    counts[key] += data["count"]
        mode_dir = Path(self.output_dir) / self.mode
        mode_dir.mkdir(parents=True, exist_ok=True)
        for key in shape_keys:
            concatenate_shard_files(shard_dirs, f"{key}_shape", mode_dir / f"{key}_shape")
        for key in sums:
            np.savez(mode_dir / f"{key}_stats.npz", count=counts[key], sum=sums[key], sum_square=squares[key])
        (mode_dir / "stats_keys").write_text("\n".join(sums) + "\n")
        return {"sum": dict(sums), "sq": dict(squares), "count": dict(counts)}


# ---- for tests/parallel/test_espnet3_conformance.py: ESPnet3's own tests' runner shapes -------------
class CallLogProvider(EnvironmentProvider):
    """``dataset``: ``config["n"]`` letters; ``model``: ``"m"``; ``log``: a file each ``forward`` call
    appends ``pid item`` to (calls are counted across processes); ``fail_marker``: while this file
    exists, ``forward`` raises on the items it lists."""

    def build_env_local(self):
        return self.build_worker_setup_fn()()

    def build_worker_setup_fn(self):
        n, log, marker = self.config["n"], self.config["log"], self.config.get("fail_marker")

        def setup():
            return {"dataset": [chr(ord("a") + i % 26) for i in range(n)], "model": "m", "log": log,
                    "fail_marker": marker}

        return setup


def logged_calls(log) -> list[tuple[int, object]]:
    """``(pid, item)`` of every ``forward`` call :class:`CallLogProvider`'s log recorded, in order."""
    import ast

    path = Path(log)
    if not path.exists():
        return []
    rows = [line.split(" ", 1) for line in path.read_text().splitlines() if line]
    return [(int(pid), ast.literal_eval(item)) for pid, item in rows]


class RecordsFileRunner(BaseRunner):
    """ESPnet3's tests' runner: env keys keyword-only in ``forward``; each result ``repr``'d into the
    shard's ``records.txt`` by its writers; ``merge`` reads them back, shard by shard."""

    @staticmethod
    def forward(idx, *, dataset, model, log, fail_marker=None, **env):
        import os

        if fail_marker and Path(fail_marker).exists() and repr(idx) in Path(fail_marker).read_text().split("\n"):
            raise RuntimeError(f"boom on {idx!r}")
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()} {idx!r}\n")
        return idx

    @staticmethod
    def open_writers(shard_dir, **env):
        return {"path": Path(shard_dir) / "records.txt", "records": []}

    @staticmethod
    def write_record(writers, result, state, **env):
        writers["records"].append(repr(result))

    @staticmethod
    def close_writers(writers, state, **env):
        writers["path"].write_text("".join(f"{r}\n" for r in writers["records"]))

    def merge(self, shard_dirs):
        import ast

        return {"records": [ast.literal_eval(line) for d in shard_dirs
                            for line in (Path(d) / "records.txt").read_text().splitlines()]}


class ForwardEnvProvider(EnvironmentProvider):
    """Env of ``dataset`` and ``model`` plus extra entries (``params``) that only ``**env`` takes."""

    def build_env_local(self):
        return self.build_worker_setup_fn()()

    def build_worker_setup_fn(self):
        n, params = self.config["n"], dict(self.params)
        return lambda: {"dataset": list(range(n)), "model": _double, **params}


class EnvEchoRunner(BaseRunner):
    """``forward`` returns the item's value and what ``**env`` holds beyond ``dataset``/``model``."""

    @staticmethod
    def forward(idx, *, dataset, model, **env):
        return {"y": model(dataset[idx]), "extra": {k: v for k, v in sorted(env.items())
                                                    if k not in ("output_dir", "shard_subdir")}}


# ---- ESPnet3's collect-stats runner, hook for hook (espnet3/components/data/collect_stats.py) ----------
class SyntheticUtterances:
    """Item ``i``: a ``(T_i, dim)`` float32 array of small integers (float32 sums of them are exact), as
    ``(uid, sample)`` when ``with_uids`` (ESPnet's preprocessor form), else the sample alone (its uid is
    then ``str(i)``)."""

    def __init__(self, n: int, dim: int = 3, base_len: int = 2, with_uids: bool = False):
        self.n, self.dim, self.base_len, self.with_uids = n, dim, base_len, with_uids

    def __len__(self):
        return self.n

    def length(self, i: int) -> int:
        return self.base_len + (7 * i) % 5

    def features(self, i: int) -> np.ndarray:
        t = np.arange(self.length(i))[:, None]
        d = np.arange(self.dim)[None, :]
        return (((i + 1) * (t + 2) + 3 * d) % 11 - 5).astype(np.float32)

    def __getitem__(self, i: int):
        sample = {"x": self.features(i), "length": self.length(i)}
        return (f"utt{i:03d}", sample) if self.with_uids else sample


def pad_collate(items):
    """``(uids, {"x": (B, T_max, dim) padded with -1, "lengths": (B,)})``, as ESPnet's collate functions."""
    uids = [uid for uid, _ in items]
    seqs = [sample["x"] for _, sample in items]
    lengths = np.array([sample["length"] for _, sample in items])
    batch = np.full((len(seqs), int(lengths.max()), seqs[0].shape[1]), -1.0, dtype=np.float32)
    for k, seq in enumerate(seqs):
        batch[k, :len(seq)] = seq
    return uids, {"x": batch, "lengths": lengths}


class ScaledFeatsModel:
    """``collect_feats(x, lengths)`` → ``{"mel": scale * x, "mel_lengths": lengths}``."""

    def __init__(self, scale: float = 2.0):
        self.scale = scale

    def collect_feats(self, *, x, lengths):
        return {"mel": x * np.float32(self.scale), "mel_lengths": lengths}


class SyntheticStatsProvider(EnvironmentProvider):
    """ESPnet3's ``CollectStatsInferenceProvider`` env: ``dataset``, ``collate_fn``, ``model``,
    ``device``, ``write_collected_feats``."""

    def build_env_local(self):
        return self.build_worker_setup_fn()()

    def build_worker_setup_fn(self):
        c = dict(self.config)

        def setup():
            return {"dataset": SyntheticUtterances(c["n"], c.get("dim", 3), c.get("base_len", 2),
                                                   c.get("with_uids", False)),
                    "collate_fn": pad_collate, "model": ScaledFeatsModel(c.get("scale", 2.0)), "device": "cpu",
                    "write_collected_feats": c.get("write_collected_feats", False)}

        return setup


class NpyListWriter:
    """``key /abs/path/key.npy`` lines, one ``.npy`` per key: the scp ESPnet2's ``NpyScpWriter`` writes."""

    def __init__(self, outdir: Path, scp: Path):
        self.dir = Path(outdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        Path(scp).parent.mkdir(parents=True, exist_ok=True)
        self.scp = open(scp, "w")  # noqa: SIM115 - open until close(), as a kaldiio writer

    def __setitem__(self, key, value):
        path = self.dir / f"{key}.npy"
        np.save(path, value)
        self.scp.write(f"{key} {path}\n")

    def close(self):
        self.scp.close()


class Espnet3SourceCollectStatsRunner(BaseRunner):
    """ESPnet3's ``CollectStatsRunner`` as its source has it: items are lists of indices (one batch
    each); ``forward`` collates them, calls ``model.collect_feats`` and returns per-key ``sum`` /
    ``sq`` / ``count`` (a key with ``{key}_lengths`` trimmed to its length, any other taken as one
    frame per utterance) and ``uid → "T,D"`` shapes (and the features with
    ``write_collected_feats``); ``write_record`` keeps the state in the writers and streams
    ``{key}_shape`` lines and ``collect_feats/{key}.scp``; the one-argument ``close_writers``
    writes ``shape_keys.txt``, ``feat_keys_written.txt``, ``stats_keys.txt`` and
    ``{key}_stats.npz`` per shard; ``merge`` sums them and concatenates shapes and scps under
    ``output_dir/<mode>``, returning ``{"sum", "sq", "count"}``."""

    def __init__(self, provider, output_dir, mode, write_collected_feats=False, **kwargs):
        super().__init__(provider, output_dir=output_dir, shard_subdir=mode, **kwargs)
        self.mode = mode
        self.write_collected_feats = write_collected_feats

    @staticmethod
    def forward(batch_indices, dataset, model, collate_fn, device, write_collected_feats=False, **env):
        ids = [int(i) for i in batch_indices] if isinstance(batch_indices, list) else [int(batch_indices)]
        items = []
        for i in ids:
            got = dataset[i]
            items.append(got if isinstance(got, tuple) else (str(i), got))
        uids, batch = collate_fn(items)
        feats = model.collect_feats(**batch)
        stats = defaultdict(lambda: {"sum": 0, "sq": 0, "count": 0})
        shapes = defaultdict(dict)
        for b, uid in enumerate(uids):
            for key, value in feats.items():
                lengths = feats.get(f"{key}_lengths")
                seq = value[b][:int(lengths[b])] if lengths is not None else value[b][None]
                stats[key]["sum"] += seq.sum(0)
                stats[key]["sq"] += (seq ** 2).sum(0)
                stats[key]["count"] += len(seq)
                shapes[key][uid] = ",".join(map(str, seq.shape))
        return (stats, shapes, feats) if write_collected_feats else (stats, shapes)

    @staticmethod
    def open_writers(shard_dir, write_collected_feats=False, **env):
        return {"_shard_dir": Path(shard_dir), "_write_feats": write_collected_feats, "shape_handles": {},
                "feat_writers": {}}

    @staticmethod
    def write_record(writers, result, state, **env):
        writers["_state"] = state
        stats, shapes, feats = result if writers["_write_feats"] else (*result, None)
        for name in ("sum", "sq", "count"):
            acc = state.setdefault(name, {})
            for key, agg in stats.items():
                acc[key] = acc[key] + agg[name] if key in acc else agg[name]
        for key, uid2shape in shapes.items():
            _write_shapes(writers, key, uid2shape)
            if feats is not None and key in feats:
                writer = writers["feat_writers"].get(key)
                if writer is None:
                    root = writers["_shard_dir"] / "collect_feats"
                    writer = writers["feat_writers"][key] = NpyListWriter(root / f"data_{key}", root / f"{key}.scp")
                lengths = feats.get(f"{key}_lengths")
                for b, uid in enumerate(uid2shape):
                    writer[uid] = feats[key][b][:int(lengths[b])] if lengths is not None else feats[key][b][None]

    @staticmethod
    def close_writers(writers):
        shard_dir = writers["_shard_dir"]
        for handle in [*writers["shape_handles"].values(), *writers["feat_writers"].values()]:
            handle.close()
        state = writers.get("_state", {})
        listed = {"shape_keys.txt": writers["shape_handles"], "feat_keys_written.txt": writers["feat_writers"],
                  "stats_keys.txt": state.get("sum", {})}
        for name, keys in listed.items():
            (shard_dir / name).write_text("".join(f"{k}\n" for k in sorted(keys)))
        for key in sorted(state.get("sum", {})):
            np.savez(shard_dir / f"{key}_stats.npz", count=state["count"][key], sum=state["sum"][key],
                     sum_square=state["sq"][key])

    def merge(self, shard_dirs):
        def lines(path):
            return path.read_text().splitlines() if path.exists() else []

        totals = {"sum": defaultdict(lambda: 0), "sq": defaultdict(lambda: 0), "count": defaultdict(lambda: 0)}
        shape_keys, feat_keys = set(), set()
        for shard_dir in shard_dirs:
            shape_keys.update(lines(shard_dir / "shape_keys.txt"))
            feat_keys.update(lines(shard_dir / "feat_keys_written.txt"))
            for key in lines(shard_dir / "stats_keys.txt"):
                with np.load(shard_dir / f"{key}_stats.npz") as data:
                    totals["sum"][key] += data["sum"]
                    totals["sq"][key] += data["sum_square"]
                    totals["count"][key] += data["count"]
        mode_dir = Path(self.output_dir) / self.mode
        mode_dir.mkdir(parents=True, exist_ok=True)
        for key in shape_keys:
            concatenate_shard_files(shard_dirs, f"{key}_shape", mode_dir / f"{key}_shape")
        if self.write_collected_feats:
            for key in feat_keys:
                concatenate_shard_files(shard_dirs, f"collect_feats/{key}.scp",
                                        mode_dir / "collect_feats" / f"{key}.scp")
        return {name: dict(acc) for name, acc in totals.items()}


def espnet3_collect_stats(provider, output_dir, mode, n_items, batch_size, write_collected_feats=False,
                          **runner_kwargs):
    """ESPnet3's ``collect_stats()`` entry point: the indices cut into batches of ``batch_size``,
    ``runner(index_batches)``, then ``{key}_stats.npz`` and ``stats_keys`` under ``output_dir/<mode>``
    from the merged totals; returns the totals."""
    batches = [list(range(i, min(i + batch_size, n_items))) for i in range(0, n_items, batch_size)]
    runner = Espnet3SourceCollectStatsRunner(provider, output_dir, mode, write_collected_feats, **runner_kwargs)
    totals = runner(batches)
    mode_dir = Path(output_dir) / mode
    for key in totals["sum"]:
        np.savez(mode_dir / f"{key}_stats.npz", count=totals["count"][key], sum=totals["sum"][key],
                 sum_square=totals["sq"][key])
    (mode_dir / "stats_keys").write_text("\n".join(totals["sum"]) + "\n")
    return totals
