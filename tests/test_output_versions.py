"""Each job's outputs on a fixed input, against the reference recorded for the job's output version.

Shard hashes hold each job's version (``hash_config()["job"]``, e.g. ``collect_stats/1``) and
:data:`~espnet3_flows.hashing.FORMAT_VERSION`, not the package's version: a release recomputes
nothing unless outputs change. So a change that changes a job's outputs must move its version (old
shards are then recomputed instead of merged with new ones); this test fails when they change
without it. Then bump the version in the job's ``hash_config`` and in :data:`JOBS`, and record the
new version's reference (on any machine)::

    python -m tests.test_output_versions extract_features/2   # writes tests/output_versions/extract_features-2.json

A reference (a few KB) holds what the published outputs are (arrays from ``.npz``, Kaldi ``.ark``
and ``.pt`` files; shape, key and speaker lists as text), not file names or paths: the text
outputs and each array's shape and dtype, compared exactly, and a sketch of each array's values
(:func:`sketch`), compared within :data:`TOLERANCE` of the array's RMS. Never an exact digest of
the values: one of rounded values held only on the machine that recorded it (a value at a
rounding boundary flips with the CPU's FFT or BLAS kernel).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any
from collections.abc import Callable

import numpy as np
import pytest

from espnet3_flows.hashing import code_salt

#: the recorded reference outputs, one JSON file per job version
REFERENCES = Path(__file__).resolve().parent / "output_versions"
TEXT_OUTPUTS = ("_shape", "_keys", "utt2spk", "skipped.tsv", "stats_keys", "batch_keys")
#: how far a sketch value may move, as a fraction of its array's RMS plus of its own size. Measured on
#: the three jobs' outputs (Xeon with AVX-512; the largest move of any sketch value of any array):
#: another machine's kernels (OPENBLAS_CORETYPE unset, Haswell, SkylakeX, Zen or Prescott; torch on
#: 1 or 2 threads; ATEN_CPU_CAPABILITY=default or avx2; MKL_ENABLE_INSTRUCTIONS=SSE4_2; all at once)
#: move them by at most 5e-8 (single log-mel values near the floor by 1.5e-4 of the RMS); one
#: frontend option changed moves them by 2e-6 (dither 0 -> 1e-5, a third of a 16-bit step), 1.6e-5
#: (dither 1e-4), 4.5e-4 (frame_length 0.025 -> 0.0249) or 3.6e-3 (0.024); another seed of the
#: x-vector model by 0.15. The tolerance is 20x the noise and below each change, 16x below all but
#: the sub-step dither.
TOLERANCE = 1e-6
#: fixed weights per array: each weighted mean sees every value, so a change anywhere moves it
PROJECTIONS = 6


def sketch(values: Any) -> list[float]:
    """A few numbers that move when any of ``values`` moves: their mean, standard deviation and
    :data:`PROJECTIONS` means weighted by fixed quasi-random weights (``cos(i * k * c)``). Each
    averages over all values, so the last-bit noise of each one (independent between values)
    cancels out where a real change (which moves many values together) does not; no min or max,
    which a single noisy value may be."""
    flat = np.asarray(values, dtype=np.float64).ravel()
    if flat.size == 0:
        return []
    index = np.arange(flat.size, dtype=np.float64)
    weighted = [float(flat @ np.cos(index * (k + 1) * 0.7548776662466927)) / flat.size for k in range(PROJECTIONS)]
    return [float(flat.mean()), float(flat.std()), *weighted]


def _arrays(path: Path) -> list[tuple[str, Any]]:
    """The arrays in one published file, each named by its file's kind and its key (a shard's
    ``.ark`` is named without the shard hash in its file name)."""
    if path.suffix == ".npz":
        with np.load(path) as z:
            return [(f"{path.stem}:{k}", z[k]) for k in z.files]
    if path.suffix == ".ark":
        import kaldiio

        return [(f"{path.name.split('.')[0]}.ark:{k}", v) for k, v in kaldiio.load_ark(str(path))]
    if path.suffix == ".pt" and path.stem != "lhotse_global_mvn":
        import torch

        value = torch.load(path, map_location="cpu", weights_only=True)
        return [(path.name, np.asarray(value))]
    return []


def read_outputs(root: Path) -> dict[str, dict[str, Any]]:
    """What the published outputs under ``root`` are: per array (``dir/key``) its shape, dtype and
    :func:`sketch`; per text output (``dir/name``) its text."""
    arrays: dict[str, Any] = {}
    texts: dict[str, str] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "shards" not in p.parts):
        rel = path.relative_to(root)
        for key, value in _arrays(path):
            value = np.asarray(value)
            arrays[f"{rel.parent}/{key}"] = {"shape": list(value.shape), "dtype": str(value.dtype),
                                             "sketch": [float(f"{x:.9g}") for x in sketch(value)]}
        if path.name.endswith(TEXT_OUTPUTS):
            texts[str(rel)] = path.read_text()
    return {"arrays": dict(sorted(arrays.items())), "texts": texts}


def differences(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]],
                tolerance: float = TOLERANCE) -> list[str]:
    """How ``got`` differs from the reference ``want`` (both from :func:`read_outputs`): structure
    and text exactly, each sketch value within ``tolerance`` of its array's RMS and of itself."""
    found = [f"{kind}: {sorted(set(got[kind]) ^ set(want[kind]))} only on one side"
             for kind in ("arrays", "texts") if set(got[kind]) != set(want[kind])]
    found += [f"{name}: text differs" for name, text in want["texts"].items() if got["texts"].get(name, text) != text]
    for name, ref in want["arrays"].items():
        new = got["arrays"].get(name)
        if new is None:
            continue
        if (new["shape"], new["dtype"]) != (ref["shape"], ref["dtype"]):
            found.append(f"{name}: {new['dtype']}{new['shape']} instead of {ref['dtype']}{ref['shape']}")
            continue
        want_sketch = np.asarray(ref["sketch"])
        rms = float(np.hypot(want_sketch[0], want_sketch[1])) if want_sketch.size else 0.0
        if not np.allclose(new["sketch"], want_sketch, rtol=tolerance, atol=tolerance * rms):
            found.append(f"{name}: sketch {new['sketch']} instead of {ref['sketch']}")
    return found


def _reference_path(version: str) -> Path:
    return REFERENCES / (version.replace("/", "-") + ".json")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_corpus(tmp_path_factory.mktemp("corpus"))


def _make_corpus(root: Path) -> Path:
    from espnet3_flows.inputs.demo import make_demo_corpus

    return make_demo_corpus(root, n_utts=12, splits={"train": 1.0})["train"]


def _collect_stats(manifest: Path, out: Path) -> Any:
    from espnet3_flows.stats.job import CollectStatsConfig, CollectStatsRunner

    return CollectStatsRunner(CollectStatsConfig(manifests={"train": str(manifest)}, output_dir=str(out),
                                                 shard_size=4), "train")


def _extract_features(manifest: Path, out: Path) -> Any:
    from espnet3_flows.features.job import ExtractFeaturesConfig, FeatureRunner

    return FeatureRunner(ExtractFeaturesConfig(manifests={"train": str(manifest)}, output_dir=str(out),
                                               shard_size=4), "train")


def _xvector(manifest: Path, out: Path) -> Any:
    from espnet3_flows.xvector.job import XVectorConfig, XVectorJobConfig, XVectorRunner
    from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir

    model = build_random_ecapa_dir(out.parent / "ecapa", seed=0)
    return XVectorRunner(XVectorJobConfig(manifests={"train": str(manifest)}, output_dir=str(out), shard_size=4,
                                          xvector=XVectorConfig(pretrained_model=str(model))), "train")


#: job version -> the runner whose outputs its reference records (update together with the version)
JOBS: dict[str, Callable[[Path, Path], Any]] = {
    "collect_stats/1": _collect_stats, "extract_features/1": _extract_features, "xvector/1": _xvector}


def run_job(version: str, corpus: Path, out: Path) -> dict[str, dict[str, Any]]:
    """Run the job recorded as ``version`` on ``corpus`` into ``out``; its :func:`read_outputs`."""
    runner = JOBS[version](corpus, out)
    assert runner.hash_config()["job"] == version, (
        f"the job's version moved to {runner.hash_config()['job']!r}: record its outputs (see this module's doc)")
    runner.run(parallel={"env": "serial"}, progress=False)
    return read_outputs(out)


@pytest.mark.parametrize("version", list(JOBS))
def test_outputs_change_only_with_the_jobs_version(version, corpus, tmp_path):
    got = run_job(version, corpus, tmp_path / "out")
    assert got["arrays"], "no outputs were read"
    found = differences(got, json.loads(_reference_path(version).read_text()))
    assert not found, (
        f"{version}'s outputs changed while its version did not: bump the version in its hash_config() so "
        f"that shards computed before are recomputed, not merged with new ones, and record its outputs (see "
        f"this module's doc):\n" + "\n".join(found))


def test_a_reference_tells_kernel_noise_from_a_change():
    rng = np.random.default_rng(0)
    values = rng.standard_normal((300, 80)).astype(np.float32) - 8.0
    ref = {"arrays": {"a": {"shape": [300, 80], "dtype": "float32", "sketch": sketch(values)}}, "texts": {}}

    def check(new: np.ndarray) -> list[str]:
        return differences({"arrays": {"a": {"shape": list(new.shape), "dtype": str(new.dtype),
                                             "sketch": sketch(new)}}, "texts": {}}, ref)

    noise = rng.standard_normal(values.shape) * 1e-4 * values.std()  # 6x the worst kernel noise measured
    assert check(values + noise.astype(np.float32)) == []
    changed = values.copy()
    changed[150, 40] += 1.0  # one value of 24,000 moved by its RMS/8
    assert check(changed) != [] and check(values[:-1]) != [] and check(values.astype(np.float64)) != []


def test_the_salt_holds_no_package_version(monkeypatch):
    import espnet3_flows

    salt = code_salt()
    assert salt == "espnet3_flows=0.1.0;format=2;"  # the shards computed so far keep their hashes
    monkeypatch.setattr(espnet3_flows, "__version__", "9.9.9")
    assert code_salt() == salt


def main(argv: list[str]) -> None:
    """Record the reference of each job version named in ``argv`` (all of :data:`JOBS` without one)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        corpus = _make_corpus(Path(tmp) / "corpus")
        for version in argv or list(JOBS):
            outputs = run_job(version, corpus, Path(tmp) / version.replace("/", "-"))
            arrays = ",\n".join(f"  {json.dumps(name)}: {json.dumps(entry)}" for name, entry in outputs["arrays"].items())
            REFERENCES.mkdir(exist_ok=True)
            _reference_path(version).write_text(f'{{"arrays": {{\n{arrays}\n }},\n "texts": '
                                                f'{json.dumps(outputs["texts"], indent=1)}}}\n')
            print(f"recorded {_reference_path(version)}")


if __name__ == "__main__":
    main(sys.argv[1:])
