"""Every command line of the README and of docs/running.md, run as a user pastes it (`$PY` the
venv's interpreter), with example paths moved under a temporary directory (the README's from the
checkout's root; docs/running.md's relative ones from a directory holding its `data/` manifests,
with the checkout's `flows/` and `conf/` beside them):

- `$PY ...` lines run here. The one that needs a SLURM cluster runs with `--dry-run` added (it
  plans and checks its cluster options against dask-jobqueue's SLURMCluster, then writes nothing;
  the SLURM tests run jobs on a real one); the ESPnet-SPK model the README names is a
  random-weight one built in its place.
- `make` lines: the target exists and `make -n` shows what it runs; the deployment block (serve,
  deploy, worker, a run, stop) is run literally by tests/deployments/test_make_stack.py, `make
  demo`'s command by tests/orchestration/test_cli.py, `make test` by CI itself.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from espnet3_flows.xvector.random_spk import build_random_espnet_spk
from tests.support.servers import cli_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.prefect, pytest.mark.dask, pytest.mark.slow]


def readme_commands(page: str = "README.md") -> list[str]:
    """A page's shell commands, continuation lines joined, comments dropped."""
    text = (ROOT / page).read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = re.sub(r"\\\n\s*", " ", "\n".join(blocks)).splitlines()
    return [line.split("  #")[0].strip() for line in lines if line.strip()]


def _kaldi_dir(path: Path, utts: int) -> None:
    rng = np.random.default_rng(len(path.name))
    path.mkdir(parents=True)
    ids = [f"spk{i % 2}-{path.name}{i:02d}" for i in range(utts)]
    for utt in ids:
        sf.write(path / f"{utt}.wav", (0.1 * rng.standard_normal(16000)).astype(np.float32), 16000)
    (path / "wav.scp").write_text("".join(f"{u} {path / u}.wav\n" for u in ids))
    (path / "utt2spk").write_text("".join(f"{u} {u.split('-')[0]}\n" for u in ids))


def test_the_readme_names_these_commands():
    commands = readme_commands()
    assert sum(c.startswith("$PY ") for c in commands) == 6 and "make demo" in commands
    made = {c.split()[1] if c.startswith("make ") else c.split("make -s ")[1].split(")")[0]
            for c in commands if "make " in c}
    assert made == {"demo", "test", "bench-quick", "python", "serve", "deploy", "worker", "stop"}, made


@pytest.mark.parametrize("target", ["demo", "test", "bench-quick", "serve", "deploy", "worker", "stop"])
def test_each_make_target_of_the_readme_exists(target):
    venv = Path(sys.executable).parent.parent
    done = subprocess.run(["make", "-n", f"VENV={venv}", f"--assume-old={venv}/.installed", target], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip(), done.stdout + done.stderr


def test_the_readme_py_lines_run_as_written(tmp_path):
    for split in ("train", "dev"):
        _kaldi_dir(tmp_path / "data" / "mycorpus" / split, 6)
    build_random_espnet_spk(tmp_path / "models" / "espnet_spk")
    venv = Path(sys.executable).parent.parent
    py = subprocess.run(["make", "-s", f"VENV={venv}", f"--assume-old={venv}/.installed", "python"], cwd=ROOT,
                        capture_output=True, text=True, timeout=60).stdout.strip()
    assert Path(py).resolve() == Path(sys.executable).resolve(), py  # `PY=$(make -s python)`
    env = cli_env(tmp_path / "prefect-home", fresh_database=True, DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")
    ran = []
    for command in (c for c in readme_commands() if c.startswith("$PY ")):
        for path in ("/data/mycorpus", "/exp/mycorpus", "/models/espnet_spk"):
            command = command.replace(path, str(tmp_path / path.strip("/")))
        if "parallel.env=slurm" in command:
            command += " --dry-run"
        done = subprocess.run(["bash", "-c", command.replace("$PY", py)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        ran.append(command)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        if "--help" in command:
            assert "frontend.type" in done.stdout
        if "--print-config" in command:
            assert "env: slurm" in done.stdout
    exp = tmp_path / "exp" / "mycorpus"
    assert (exp / "stats" / "train" / "feats_stats.npz").is_file() and (exp / "stats" / "valid").is_dir()
    assert (exp / "xvectors" / "espnet_spk" / "train" / "espnet_spk.scp").is_file()
    assert len(ran) == 6


def _tsv(path: Path, audio: Path, utts: int) -> None:
    rng = np.random.default_rng(utts)
    audio.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(utts):
        wav = audio / f"{path.stem}{i:02d}.wav"
        sf.write(wav, (0.1 * rng.standard_normal(16000)).astype(np.float32), 16000)
        lines.append(f"{path.stem}{i:02d}\t{wav}\tsome text\tspk{i % 2}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))


def test_the_running_page_commands_run_as_written(tmp_path):
    from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir

    work = tmp_path / "work"
    for split in ("train", "valid"):
        _tsv(work / "data" / f"{split}.tsv", tmp_path / "audio", 6)
    for linked in ("flows", "conf"):
        (work / linked).symlink_to(ROOT / linked)
    build_random_ecapa_dir(tmp_path / "models" / "ecapa")
    env = cli_env(tmp_path / "prefect-home", fresh_database=True, DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")
    commands = [c for c in readme_commands("docs/running.md") if c.startswith("$PY ")]
    assert len(commands) == 7
    for command in commands:
        command = command.replace("/models/ecapa", str(tmp_path / "models" / "ecapa"))
        if "stats_slurm" in command:
            command += " --dry-run"
        if "espnet3_flows.batching --shape-file" in command:  # what `make demo` leaves there
            (work / "exp" / "collect_stats" / "train").mkdir(parents=True, exist_ok=True)
            (work / "exp" / "collect_stats" / "train" / "feats_shape").write_bytes(
                (work / "exp" / "stats" / "train" / "feats_shape").read_bytes())
        done = subprocess.run(["bash", "-c", command.replace("$PY", sys.executable)], cwd=work, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    assert (work / "exp" / "stats" / "valid" / "feats_stats.npz").is_file()
    assert (work / "exp" / "xvectors" / "xvector" / "train" / "xvector.scp").is_file()
    assert (work / "exp" / "batches" / "batches" / "train.txt").is_file()  # DIR/batches/<split>.txt
