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
        log = open(shard_dir / "hooks.log", "w")
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
        feats = self.frontend([s[:n] for s, n in zip(speech, speech_lengths)], {})
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
            handle = writers["shape_handles"].get(key)
            if handle is None:
                handle = writers["shape_handles"][key] = (writers["_shard_dir"] / f"{key}_shape").open("w")
            for uid, shape in uid2shape.items():
                handle.write(f"{uid} {shape}\n")

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
