"""docs/walkthrough.md, run from its text: its `run` blocks in order as a user's shell runs them
(the environment's `python` and `prefect` on PATH), its `file` blocks written where they say,
against a real Prefect server and process worker.

The page's absolute paths are moved under a temporary directory, and the only step that cannot
run offline is replaced: the speaker model the page tells you to download is a random-weight
ECAPA-TDNN built in its place (same files, same loader).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir
from tests.support.servers import PrefectServer, PrefectWorker, cli_env

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "walkthrough.md"
# ~2 min on 2 cores: every command of the page, a server, a worker and its deployment runs included
pytestmark = [pytest.mark.prefect_server, pytest.mark.slow, pytest.mark.timeout(420)]
#: the page's paths, moved under the test's directory
PATHS = ("/data/mycorpus", "/exp/mycorpus", "/models/ecapa", "/home/me/mycorpus_jobs")
_STEP = re.compile(r"<!-- walkthrough: (run|file (\S+)) -->\n```\w*\n(.*?)```", re.S)


def steps(text: str) -> list[tuple[str, str, str]]:
    """``(kind, file path or "", body)`` of every marked block, in page order."""
    return [("file" if m[2] else "run", m[2] or "", m[3]) for m in _STEP.finditer(text)]


def _kaldi_dir(path: Path, audio: Path, utts: int, speakers: int, seed: int) -> list[str]:
    """A Kaldi data directory of ``utts`` noise utterances (1–2.5 s, 8 kHz: the page's corpus) by ``speakers``."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    audio.mkdir(parents=True, exist_ok=True)
    ids = [f"spk{i % speakers}-{path.name}{i:03d}" for i in range(utts)]
    for utt in ids:
        wave = 0.1 * rng.standard_normal(int(8000 * rng.uniform(1.0, 2.5)))
        sf.write(audio / f"{utt}.wav", wave.astype(np.float32), 8000, subtype="PCM_16")
    ids.sort()
    (path / "wav.scp").write_text("".join(f"{u} {audio / u}.wav\n" for u in ids))
    (path / "utt2spk").write_text("".join(f"{u} {u.split('-')[0]}\n" for u in ids))
    (path / "text").write_text("".join(f"{u} hello world\n" for u in ids))
    return ids


def _api(url: str, path: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def test_the_walkthrough_runs_as_written(tmp_path):
    moved = {p: str(tmp_path / p.strip("/")) for p in PATHS}
    train = _kaldi_dir(Path(moved["/data/mycorpus"]) / "train", tmp_path / "audio", 12, 3, 0)
    _kaldi_dir(Path(moved["/data/mycorpus"]) / "dev", tmp_path / "audio", 6, 3, 1)
    build_random_ecapa_dir(Path(moved["/models/ecapa"]))  # instead of the page's download
    Path(moved["/home/me/mycorpus_jobs"]).mkdir(parents=True)
    page = PAGE.read_text()
    found = steps(page)
    assert [k for k, _, _ in found].count("run") >= 7 and [k for k, _, _ in found].count("file") == 4

    venv_bin = str(Path(sys.executable).parent)
    env = cli_env(tmp_path / "prefect-home", fresh_database=True, DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")
    env["PATH"] = f"{venv_bin}{os.pathsep}{env['PATH']}"  # what `source .../activate` does
    env.pop("PYTHONPATH", None)  # the installed package, as a user has it
    with PrefectServer(tmp_path / "server-home", log_dir=tmp_path / "logs") as server:
        moved["http://127.0.0.1:4200/api"] = server.api_url
        worker = None
        outputs: list[str] = []
        runs: list[str] = []
        try:
            for kind, where, body in found:
                for old, new in moved.items():
                    body, where = body.replace(old, new), where.replace(old, new)
                if kind == "file":
                    Path(where).write_text(body)
                    continue
                if "prefect deployment run" in body and worker is None:  # "with a worker running"
                    worker = PrefectWorker("espnet3", env, tmp_path, log_dir=tmp_path / "logs")
                    worker.start()
                done = subprocess.run(["bash", "-e", "-c", body], cwd=tmp_path, env=env, capture_output=True,
                                      text=True, timeout=900)
                assert done.returncode == 0, f"{body}\n---\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
                outputs.append(done.stdout + done.stderr)
                if "prefect deployment run" in body:
                    runs = re.findall(r"UUID: ([0-9a-f-]{36})", outputs[-1])
                exported = re.search(r"^export PREFECT_API_URL=(\S+)", body, re.M)
                if exported:  # the user's shell keeps it for the next commands
                    env["PREFECT_API_URL"] = exported.group(1)
        finally:
            if worker is not None:
                worker.stop()
        deployments = {d["name"]: d for d in _api(server.api_url, "deployments/filter", {})}
        states = [_api(server.api_url, f"flow_runs/{run}")["state_type"] for run in runs]

    # every job has its nightly deployment, and each ran now as the page says
    for name in ("mycorpus-stats-nightly", "mycorpus-xvectors-nightly", "mycorpus-utt2dur-nightly"):
        crons = [s["schedule"].get("cron") for s in deployments[name]["schedules"] if s["active"]]
        assert crons == ["0 3 * * *"], deployments[name]["schedules"]
    assert len(runs) == 3 and states == ["COMPLETED"] * 3, outputs[-1][-3000:]
    exp = Path(moved["/exp/mycorpus"])
    assert {p.name for p in (exp / "stats").iterdir()} >= {"train", "valid"}
    # the nightly run took the command line's config file: the 8 kHz frontend that owns the outputs
    # (without it, the run was refused: outputs made with frontend.sampling_rate=8000)
    for split in ("train", "valid"):
        owner = json.loads((exp / "stats" / split / "owner.json").read_text())
        assert owner["config"]["frontend"]["sampling_rate"] == 8000, owner
    assert "warning" not in outputs[0] and "0 bad" in outputs[0], outputs[0]
    assert (exp / "stats" / "valid" / "speech_shape").read_text().count("\n") == 6
    assert "12 utterances, 3 speakers, dim 192" in "".join(outputs)
    durations = dict(line.split() for line in (exp / "utt2dur" / "train" / "utt2dur").read_text().splitlines())
    assert sorted(durations) == train
    audio_dir = tmp_path / "audio"
    assert all(abs(float(d) - sf.info(str(audio_dir / f"{u}.wav")).duration) < 1e-3 for u, d in durations.items())


def test_every_shell_block_of_the_walkthrough_is_run_or_said_not_to_be():
    """The blocks the test does not run: the venv's activation (the test puts it on PATH), a
    worker in the foreground (the test starts one), ESPnet2's training options (not commands)."""
    text = PAGE.read_text()
    unmarked = [m[1] for m in re.finditer(r"(?<!-->\n)```(\w+)\n(.*?)```", text, re.S)]
    bodies = [m[2].strip() for m in re.finditer(r"(?<!-->\n)```(\w+)\n(.*?)```", text, re.S)]
    assert unmarked == ["bash", "text", "bash"], unmarked
    assert bodies[0].startswith("source ") and bodies[2] == "prefect worker start --pool espnet3"
