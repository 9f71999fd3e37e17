"""The external sort behind sorted shape files and Kaldi-dir joins: the order of ``sorted`` (stable),
runs on disk merged in rounds, memory flat in the number of rows, no run file left behind."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from espnet3_flows import external_sort
from espnet3_flows.external_sort import sorted_lines, sorted_rows


def _lines(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    # duplicate keys (stability), ids that sort differently as text and as numbers, non-ASCII
    keys = [f"utt{rng.randrange(n // 2 + 1)}" for _ in range(n)] + ["é-1", "Z", "a b", "10", "9"]
    return [f"{k}\t{i}" if " " not in k else f"{k}" for i, k in enumerate(keys)]


@pytest.mark.parametrize("chunk,fan_in", [(10_000, 128), (7, 128), (3, 2)], ids=["memory", "runs", "rounds"])
def test_sorted_lines_equals_a_stable_sort_on_the_first_field(tmp_path, monkeypatch, chunk, fan_in):
    monkeypatch.setattr(external_sort, "FAN_IN", fan_in)
    lines = _lines(200)
    got = list(sorted_lines(iter(lines), str(tmp_path), chunk_rows=chunk))
    assert got == sorted(lines, key=lambda ln: ln.split(None, 1)[0])
    assert list(tmp_path.iterdir()) == []  # every run removed once merged


def test_sorted_rows_with_a_codec(tmp_path):
    rows = [(f"k{i % 5}", i, "x\ty") for i in range(50)][::-1]
    got = list(sorted_rows(rows, lambda r: (r[0], r[1]), str(tmp_path), chunk_rows=4,
                           encode=lambda r: f"{r[0]}\t{r[1]}\t{r[2]}",
                           decode=lambda s: (lambda k, i, rest: (k, int(i), rest))(*s.split("\t", 2))))
    assert got == sorted(rows, key=lambda r: (r[0], r[1]))


def test_rows_sort_in_flat_memory(tmp_path):
    n, chunk = 300_000, 10_000  # 30 runs: memory is a chunk and a row per run, whatever n is
    rows = (f"utt{(i * 7919) % n:07d}\t{i % 400 + 100},80" for i in range(n))  # a permutation
    tracemalloc.start()
    try:
        previous, count = "", 0
        for line in sorted_lines(rows, str(tmp_path), chunk_rows=chunk):
            key = line.split("\t", 1)[0]
            assert key >= previous
            previous, count = key, count + 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == n
    # one chunk of rows (~1.5 MB here) and a buffered row per run: not the ~25 MB of all the rows
    assert peak < 5 * 2**20, f"peak {peak / 2**20:.1f} MiB"
