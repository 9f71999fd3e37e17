"""The GPU check on the CPU, as the device runs it (``benchmarks/gpu_check.sh --device cpu --quick
--rehearse``), and the wheels it carries (``benchmarks/gpu_wheels.sh``): every step the lent GPU
machine takes has run here first."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PARTS = ("hubert", "fbank", "ecapa", "rawnet3", "local_gpu", "datapath")


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_WHEELS": str(out / "no-wheels"),
           "ESPNET3_BENCH_DATA": str(out / "data"), "GPU_CHECK_SITE": str(out / "site")}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(REPO / "benchmarks" / "gpu_check.sh"), "--device", "cpu", "--quick", "--rehearse"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    return out, proc


@pytest.mark.slow
@pytest.mark.dask
def test_rehearsal_runs_every_part_and_the_tests(rehearsal):
    out, proc = rehearsal
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    # as on the device without Prefect's wheels: the flow test is left out, saying so
    assert "no Prefect here: the flow test on local_gpu is left out" in proc.stdout
    assert re.search(r"^\d+ passed, \d+ deselected in ", proc.stdout, re.M), proc.stdout[-6000:]
    assert not re.search(r"\d+ (failed|error)", proc.stdout)
    assert "gpu_check: tests exit 0, benchmarks exit 0" in proc.stdout
    # the tables come last, after the summary line
    last = proc.stdout.split("gpu_check: tests exit 0, benchmarks exit 0", 1)[1]
    assert "Device: CPU" in last and "| HuBERT-base |" in last and "| collect-stats (engine) |" in last
    result = json.loads((out / "gpu.json").read_text())
    assert result["name"] == "gpu" and result["quick"] is True and not result["failures"]
    assert result["command"] == "benchmarks/gpu_check.sh --quick"
    assert {r["part"] for r in result["rows"]} == set(PARTS)
    for part in PARTS:
        data = json.loads((out / "gpu" / f"{part}.json").read_text())
        assert data["part"] == part and data["rows"], part
    assert (out / "gpu_check.log").read_text().count("[gpu]") >= 2 * len(PARTS)


@pytest.mark.slow
@pytest.mark.dask
def test_rehearsal_measures_what_the_issue_asks(rehearsal):
    out, _ = rehearsal
    rows = json.loads((out / "gpu.json").read_text())["rows"]
    hubert = [r for r in rows if r["part"] == "hubert"]
    assert {r["mode"] for r in hubert} == {"one at a time", "batched", "collect-stats moments",
                                           "model only (batches on the device)", "written, calls of 16",
                                           "written, calls of 256", "padded as they are, second pass",
                                           "bucket shapes"}
    fixed = {r["mode"]: r for r in hubert if "shapes" in r}
    assert fixed["bucket shapes"]["padding"] >= fixed["padded as they are, second pass"]["padding"]
    assert fixed["bucket shapes"]["max_rel"] < 1e-5  # float32 on the CPU: exact as the batches as they are
    assert all(r["x_realtime"] > 0 for r in hubert if r["mode"].startswith("written"))  # features were written
    batched = {r["precision"]: r for r in hubert if r["mode"] == "batched"}
    assert batched["float32"]["max_rel"] < 1e-5  # exact padded batches
    assert 1e-4 < batched["bf16"]["rel_rms"] < 0.1  # reduced precision: its error is measured, not zero
    moments = {r["precision"]: r for r in hubert if r["mode"] == "collect-stats moments"}
    assert moments["float32"]["stats_rel_diff"] <= 1e-6 and moments["bf16"]["stats_rel_diff"] > 0
    fbank = {r["mode"]: r for r in rows if r["part"] == "fbank"}
    assert fbank["cpu, gathered batches"]["stats_rel_diff"] <= 1e-5
    assert fbank["cpu, collect-stats moments"]["stats_rel_diff"] <= 1e-5
    for part in ("ecapa", "rawnet3"):
        exact = [r for r in rows if r["part"] == part and r["precision"] == "float32"]
        assert len(exact) >= 2 and min(r["min_cosine_vs_alone"] for r in exact) >= 0.99999
    decode = [r for r in rows if r["part"] == "datapath"]
    assert [r["threads"] for r in decode][:2] == [1, 2] and all(r["audio_s_per_s"] > 0 for r in decode)
    local = [r for r in rows if r["part"] == "local_gpu"]
    assert local[-1]["stats_rel_diff"] <= 1e-5 and local[-1]["computed"] == local[-1]["shards"]


def test_every_carried_wheel_has_a_tested_pin():
    names = [line.split("#")[0].strip() for line in (REPO / "benchmarks" / "gpu-wheels.txt").read_text().splitlines()]
    pins = {line.split("==")[0].lower().replace("_", "-").replace(".", "-")
            for line in (REPO / "constraints-gpu.txt").read_text().splitlines() if "==" in line}
    missing = [n for n in names if n and n.lower().replace("_", "-").replace(".", "-") not in pins]
    assert not missing, f"no pin in constraints-gpu.txt for {missing}"


@pytest.mark.slow
def test_gpu_wheels_downloads_the_list_for_python_3_12(tmp_path):
    """The registry is reachable here (CI's too); Prefect's ~85 wheels are left out to keep it short."""
    dest = tmp_path / "whl"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_WHEELS_DIR": str(dest)}
    proc = subprocess.run([str(REPO / "benchmarks" / "gpu_wheels.sh"), "--no-prefect"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"gpu-wheels: \d+ wheels in .*Left out: Prefect \(--no-prefect\)\.", proc.stdout), proc.stdout
    wheels = sorted(dest.glob("*.whl"))
    names = [line.split("#")[0].strip() for line in (REPO / "benchmarks" / "gpu-wheels.txt").read_text().splitlines()]
    assert len(wheels) == len([n for n in names if n])
    for wheel in wheels:
        tags = wheel.stem.split("-")[-3:]
        assert tags[0] in ("py3", "py2.py3", "cp312", "cp311", "cp310"), wheel.name
        assert tags[2] == "any" or "x86_64" in tags[2], wheel.name
        with zipfile.ZipFile(wheel) as z:
            assert any(n.endswith("/METADATA") for n in z.namelist()), wheel.name
