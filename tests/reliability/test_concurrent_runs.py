"""Two runs started together on one output_dir give the same correct result as one clean run."""

from __future__ import annotations

import multiprocessing as mp
import queue
from pathlib import Path

import numpy as np

from espnet3_flows.config import load_config
from espnet3_flows.stats import CollectStatsConfig, CollectStatsRunner


def _run(manifest: str, out: str, barrier, results=None) -> int:
    cfg = load_config(CollectStatsConfig, overrides=[f"manifests.train={manifest}", f"output_dir={out}",
                                                     "shard_size=4", "parallel.env=serial"])
    runner = CollectStatsRunner(cfg, "train")
    shards = len(runner.plan().shards)
    barrier.wait()
    computed = runner.run(progress=False).computed
    if results is not None:
        results.put((computed, shards))
    return computed


def test_two_concurrent_runs_same_output(demo_corpus, tmp_path):
    out = str(tmp_path / "shared")
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_run, args=(demo_corpus["train"], out, barrier, results)) for _ in range(2)]
    try:
        for p in procs:
            p.start()
        got: list[tuple[int, int]] = []
        while len(got) < len(procs):  # a run that failed puts nothing: it is named, never waited on
            try:
                got.append(results.get(timeout=1))
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not failed, f"a run failed (exit codes {failed}): its error is in the captured stderr"
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    computed, shards = [c for c, _ in got], got[0][1]
    # between them every shard was computed; a shard the other run published meanwhile is reused
    # (each run reads a shard's done record again before it computes it), so one may compute none
    assert sum(computed) >= shards, (computed, shards)
    clean = str(tmp_path / "clean")
    _run(demo_corpus["train"], clean, _NoBarrier())
    a, b = np.load(f"{out}/train/feats_stats.npz"), np.load(f"{clean}/train/feats_stats.npz")
    assert int(a["count"]) == int(b["count"])
    np.testing.assert_allclose(a["sum_square"], b["sum_square"], rtol=1e-12)
    for name in ("feats_shape", "speech_shape", "stats_keys", "batch_keys"):
        assert Path(out, "train", name).read_bytes() == Path(clean, "train", name).read_bytes()
    assert not [p for p in Path(out).rglob("*") if ".tmp-" in p.name]


def test_a_shard_published_by_another_run_while_this_one_computed_it_is_kept(demo_corpus, tmp_path):
    """The interleaving of two runs behind the test above, made certain: run B found shard 0 not
    done and computed it; run A published it meanwhile (and may be merging). B keeps A's record and
    files (it never removes the record A's merge reads) and publishes nothing of its own."""
    from espnet3_flows.parallel.worker_registry import worker_resources

    out = tmp_path / "out"
    cfg = load_config(CollectStatsConfig, overrides=[f"manifests.train={demo_corpus['train']}", f"output_dir={out}",
                                                     "shard_size=4", "parallel.env=serial"])
    runner_a, runner_b = CollectStatsRunner(cfg, "train"), CollectStatsRunner(cfg, "train")
    shard = runner_b.plan().shards[0]
    assert runner_b.load_done(shard) is None
    runner_a.run(progress=False)
    done = out / "train" / "shards" / shard.name / "done"
    files = sorted(p for p in done.parent.iterdir() if p.is_file())
    before = {p.name: (p.stat().st_ino, p.read_bytes()) for p in files}

    kept = runner_b.run_shard(shard, worker_resources(runner_b.provider, local=True), run_id="run-b")

    assert kept.run_id != "run-b" and kept.shard.hash == shard.hash
    after = {p.name: (p.stat().st_ino, p.read_bytes()) for p in sorted(done.parent.iterdir()) if p.is_file()}
    assert after == before, "run B replaced files of a shard run A had published"
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]


def test_a_forced_recompute_still_replaces_the_shard(demo_corpus, tmp_path):
    """``resume=False`` asks for the computation again: the record is replaced, not kept."""
    from espnet3_flows.parallel.worker_registry import worker_resources

    out = tmp_path / "out"
    overrides = [f"manifests.train={demo_corpus['train']}", f"output_dir={out}", "shard_size=4", "parallel.env=serial"]
    CollectStatsRunner(load_config(CollectStatsConfig, overrides=overrides), "train").run(progress=False)
    runner = CollectStatsRunner(load_config(CollectStatsConfig, overrides=overrides), "train")
    runner.resume = False  # BaseRunner(resume=False), as ESPnet3's runners take it
    shard = runner.plan().shards[0]
    rec = runner.run_shard(shard, worker_resources(runner.provider, local=True), run_id="forced")
    assert rec.run_id == "forced"
    assert runner.read_done(shard.hash).run_id == "forced"


class _NoBarrier:
    def wait(self) -> None:
        pass
