"""What holds on S3 as on local disk, against a real S3 endpoint (moto on loopback): a split
directory is claimed by one run even when two claim it together over a slow link (conditional
writes), and a shard file replaced by other content of the same size is recomputed, never merged
(the content check compares the SHA-256 of the ``done`` record, not the size)."""

from __future__ import annotations

import posixpath
import threading
import time

import pytest
import s3fs

from espnet3_flows.config import load_config
from espnet3_flows.orchestration.job_run import plan_job
from espnet3_flows.parallel.scheduler import InProcessExecutor, run_planned
from espnet3_flows.split_outputs import OWNER, OutputsOwnedError, claim_outputs
from espnet3_flows.stats import CollectStatsConfig
from espnet3_flows.storage import Storage
from tests.support.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.s3]
#: claim races per test: in each, a run behind a slow link (each chunk held LATENCY seconds each
#: way) and a run next to the store, the near one starting ``i × LAG_STEP`` seconds later. The lags
#: span the far run's read, write and read back, so a claim that is not exclusive (read, write,
#: read back) lets both runs win at some lags, whatever the machine's speed: the near run claims
#: between the far run's read and its write, which then replaces the near run's record
TRIES = 12
LAG_STEP = 0.1
LATENCY = 0.1


def test_two_runs_claiming_one_s3_directory_over_a_slow_link_one_wins_every_time(moto_server, s3_output):
    url, options = s3_output
    outcomes: dict[tuple[int, int], str] = {}
    with TcpProxy(moto_server.port, delay=LATENCY) as proxy:
        barrier = threading.Barrier(2 * TRIES)
        # the far runs' client and the near runs' (each its own connections, as two processes)
        stores = {mels: Storage(url, {**options, "client_kwargs": {"endpoint_url": endpoint},
                                      "skip_instance_cache": True})
                  for mels, endpoint in ((40, proxy.url), (80, moto_server.endpoint_url))}

        def claim(i: int, mels: int) -> None:
            barrier.wait()
            time.sleep(0.0 if mels == 40 else i * LAG_STEP)
            try:
                claim_outputs(stores[mels], f"try{i}/train", "collect_stats", {"frontend": {"num_mel_bins": mels}})
                outcomes[(i, mels)] = "ok"
            except OutputsOwnedError as exc:
                outcomes[(i, mels)] = str(exc)

        threads = [threading.Thread(target=claim, args=(i, mels)) for i in range(TRIES) for mels in (80, 40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    direct = Storage(url, options)
    for i in range(TRIES):
        got = {mels: outcomes.get((i, mels), "no answer") for mels in (80, 40)}
        winners = [mels for mels, v in got.items() if v == "ok"]
        assert len(winners) == 1, f"try {i} (the near run {i * LAG_STEP:.1f} s later): {got}"
        loser = got[120 - winners[0]]
        assert f"{url}/try{i}/train/{OWNER}" in loser, loser
        owner = direct.read_json(posixpath.join(f"try{i}", "train", OWNER))
        assert owner["config"]["frontend"]["num_mel_bins"] == winners[0], (i, owner)


def _run(manifest: str, url: str, options: dict) -> None:
    cfg = load_config(CollectStatsConfig, base={"storage_options": options},
                      overrides=[f"manifests.train={manifest}", f"output_dir={url}", "shard_size=4",
                                 "parallel.env=serial"])
    run = plan_job("collect_stats", cfg)
    if run.unchanged_summaries is None:
        run_planned(run.runners, InProcessExecutor(), progress=False)


def test_a_shard_file_on_s3_replaced_by_other_content_of_the_same_size_is_recomputed(demo_corpus, s3_output):
    url, options = s3_output
    root = url.removeprefix("s3://")
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)  # as another tool would write it
    _run(demo_corpus["valid"], url, options)
    clean = fs.cat_file(f"{root}/train/feats_shape")
    shapes = sorted(fs.glob(f"{root}/train/shards/*/shapes.tsv"))[0]
    original = fs.cat_file(shapes)
    # the first line's first number after the id changed in its first digit: the same size, other content
    at = next(i for i in range(original.index(b"\t"), len(original)) if original[i:i + 1].isdigit())
    edited = original[:at] + (b"2" if original[at:at + 1] == b"1" else b"1") + original[at + 1:]
    assert len(edited) == len(original) and edited != original
    fs.pipe_file(shapes, edited)
    fs.rm_file(f"{root}/train/summary.json")  # the split is merged again (not trusted as it is)
    _run(demo_corpus["valid"], url, options)
    assert fs.cat_file(shapes) == original  # the shard was computed again and published anew
    assert fs.cat_file(f"{root}/train/feats_shape") == clean
