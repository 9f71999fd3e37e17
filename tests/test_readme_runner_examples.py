"""The examples of docs/runners.md and docs/coming-from-espnet3.md, run as written: the
Provider/Runner pair in this process, the same runner under ``runner_flow`` on a 2-worker
LocalCluster, a flow file of a user's own, outside this package, deployed with the README's
``prefect.yaml`` to a real Prefect server, triggered, its outputs read; and the HuBERT statistics
through ``get_client(plugin)`` / ``parallel_map`` and through a ``setup_fn``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("docs/runners.md", "docs/coming-from-espnet3.md")
_EXAMPLE = re.compile(r"<!-- example: ([\w-]+)[^>]*-->\n```(?:python|yaml)\n(.*?)```", re.S)


def examples() -> dict[str, str]:
    """Example name → its code, from the pages that hold them."""
    return {m[1]: m[2] for page in PAGES for m in _EXAMPLE.finditer((ROOT / page).read_text())}


def _definitions() -> str:
    """The provider-runner example without its run (the block under its main guard)."""
    code = examples()["provider-runner"]
    return code[:code.index('if __name__ == "__main__":')]


def _run_example(name: str, namespace: dict) -> dict:
    """Run an example as the script it is (``__name__`` is ``"__main__"``, so its guarded run
    runs) in a namespace that is no importable module: Dask ships its classes by value, as it
    does a script's or a notebook's."""
    namespace["__name__"] = "__main__"
    exec(compile(examples()[name], f"docs:{name}", "exec"), namespace)
    return namespace


def test_the_examples_are_there():
    assert {"provider-runner", "runner-flow", "user-flow", "user-prefect-yaml", "hubert-plugin", "setup-fn"} <= \
        set(examples())


def test_provider_runner_example(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ns = _run_example("provider-runner", {})
    text = (tmp_path / "exp/my_text/text").read_text().splitlines()
    assert len(text) == 1000 and text[0] == "utt00000 UTTERANCE NUMBER 0" and text[-1] == "utt00999 UTTERANCE NUMBER 999"
    printed = capsys.readouterr().out
    shards = len(list((tmp_path / "exp/my_text").glob("split.*/done")))
    assert f"{{'shards': {shards}}}" in printed and shards > 1
    again = ns["runner"].run(range(1000), progress=False)
    assert again.computed == 0 and again.merged == {"shards": shards}


@pytest.mark.prefect
@pytest.mark.dask
def test_runner_flow_example(prefect_harness, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": "readme_runner_flow"}
    exec(compile(_definitions(), "docs/runners.md", "exec"), ns)  # the provider and runner, then the example
    _run_example("runner-flow", ns)
    shards = len(list((tmp_path / "exp/my_text").glob("split.*/done")))
    assert ns["result"] == {"shards": shards} and shards > 1
    assert len((tmp_path / "exp/my_text/text").read_text().splitlines()) == 1000


@pytest.mark.prefect_server
@pytest.mark.slow
def test_a_users_flow_file_deploys_and_runs(tmp_path):
    from tests.support.servers import PrefectServer, PrefectWorker

    project, out, elsewhere = tmp_path / "my_project", tmp_path / "data" / "my_text", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "my_runners.py").write_text(_definitions())
    (project / "my_text_flow.py").write_text(examples()["user-flow"])
    (project / "prefect.yaml").write_text(examples()["user-prefect-yaml"].replace("/path/to/my_project", str(project))
                                          .replace("/data/exp/my_text", str(out)))
    with PrefectServer(tmp_path / "home", log_dir=tmp_path / "logs") as server:
        env = {k: v for k, v in server.env().items() if k != "PYTHONPATH"}  # the project is not on any path
        cli = [str(Path(sys.executable).with_name("prefect")), "--no-prompt"]
        for args in (["work-pool", "create", "espnet3", "--type", "process"], ["deploy", "--all"]):
            proc = subprocess.run([*cli, *args], cwd=project, env=env, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        env |= {"PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        with PrefectWorker("espnet3", env, elsewhere, log_dir=tmp_path / "logs"):
            from prefect.deployments import run_deployment
            from prefect.settings import PREFECT_API_URL, temporary_settings

            previous = os.environ.get("PREFECT_API_URL")
            os.environ["PREFECT_API_URL"] = server.api_url
            try:
                with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
                    run = run_deployment("my-text/my-text", parameters={"n": 40}, timeout=300)
            finally:
                if previous is None:
                    os.environ.pop("PREFECT_API_URL", None)
                else:
                    os.environ["PREFECT_API_URL"] = previous
            assert run.state is not None and run.state.is_completed(), run.state
    lines = (out / "text").read_text().splitlines()
    assert len(lines) == 40 and lines[7] == "utt00007 UTTERANCE NUMBER 7"
    assert len(list(out.glob("split.*/done"))) >= 1


def _wav_paths(demo_corpus: dict[str, str]) -> list[str]:
    return [line.split("\t")[1] for line in Path(demo_corpus["valid"]).read_text().splitlines()[:6]]


@pytest.mark.dask
def test_hubert_plugin_example(demo_corpus):
    import numpy as np
    import soundfile as sf
    import torch
    import torchaudio

    from espnet3_flows.parallel import set_parallel

    paths = _wav_paths(demo_corpus)
    torch.manual_seed(0)
    try:
        ns = _run_example("hubert-plugin", {"wav_paths": paths})
    finally:
        set_parallel(None)
    dim = ns["mean"].shape
    assert dim == (768,) and np.isfinite(ns["var"]).all() and (ns["var"] > 0).all()
    # the frames of each file, as the model gives them (weights differ per worker; the count does not)
    model = torchaudio.models.hubert_base().eval()
    expected = 0
    for path in paths:
        wav, _ = sf.read(path, dtype="float32")
        with torch.inference_mode():
            expected += model.extract_features(torch.from_numpy(wav)[None])[0][-1].shape[1]
    assert ns["count"] == expected


@pytest.mark.dask
def test_setup_fn_example(demo_corpus, capsys):
    from espnet3_flows.parallel import set_parallel

    paths = _wav_paths(demo_corpus)
    try:
        ns = _run_example("setup-fn", {"wav_paths": paths})
    finally:
        set_parallel(None)
    assert len(ns["frames"]) == len(paths) and all(n > 0 for n in ns["frames"])
    printed = [int(line) for line in capsys.readouterr().out.split()]
    assert sorted(printed) == sorted(ns["frames"])
