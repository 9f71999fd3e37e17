"""Every example in conf/ loads and plans as a user would run it: ``--config conf/X.yaml --dry-run``
with only its data locations overridden (a renamed key or a bad cluster option in an example fails
here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.servers import cli_env

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "conf").glob("*.yaml"))
pytestmark = pytest.mark.slow


def test_there_are_examples_for_each_kind_of_site():
    assert {p.stem for p in EXAMPLES} >= {"stats_local", "stats_slurm_cpu", "stats_slurm_gpu", "stats_s3", "stats_ssh",
                                          "xvectors", "xvectors_espnet"}


@pytest.fixture(scope="module")
def ecapa_dir(tmp_path_factory) -> Path:
    from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir

    return build_random_ecapa_dir(tmp_path_factory.mktemp("ecapa") / "model")


@pytest.fixture(scope="module")
def espnet_spk_model(tmp_path_factory) -> Path:
    from espnet3_flows.xvector.random_spk import build_random_espnet_spk

    return build_random_espnet_spk(tmp_path_factory.mktemp("espnet_spk"), "rawnet3")


def _hub_cache(pth: Path, cache: Path, tag: str) -> None:
    """``pth`` and its config.yaml as an ESPnet model package in a Hugging Face cache (meta.yaml)."""
    import shutil

    repo = cache / f"models--{tag.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    (snapshot / "exp").mkdir(parents=True)
    shutil.copy(pth, snapshot / "exp" / "model.pth")
    shutil.copy(pth.parent / "config.yaml", snapshot / "exp" / "config.yaml")
    (snapshot / "meta.yaml").write_text("files:\n  model_file: exp/model.pth\nyaml_files:\n  train_config: exp/config.yaml\n")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_config_plans_with_dry_run(example, tmp_path, demo_corpus, ecapa_dir, request):
    conf = yaml.safe_load(example.read_text())
    env = cli_env(tmp_path / "home", drop=("AWS_",), HF_HUB_OFFLINE="1")
    manifest = demo_corpus["valid"]
    if "xvector" in conf:
        job = "extract_xvectors"
        overrides = [f"xvector.manifest_paths.{split}={manifest}" for split in conf["xvector"]["manifest_paths"]]
        overrides += [f"xvector.save_path={tmp_path / 'out'}"]
        if conf["xvector"].get("toolkit") == "espnet":
            # the example's model tag, found in a Hugging Face cache as a download would leave it
            _hub_cache(request.getfixturevalue("espnet_spk_model"), tmp_path / "hub", conf["xvector"]["pretrained_model"])
            env["HF_HUB_CACHE"] = str(tmp_path / "hub")
        else:
            overrides.append(f"xvector.pretrained_model={ecapa_dir}")
    else:
        job = "collect_stats"
        out = str(tmp_path / "out")
        if str(conf.get("output_dir", "")).startswith("s3://"):
            moto = request.getfixturevalue("moto_server")
            url, options = request.getfixturevalue("s3_output")
            bucket = url[len("s3://"):].split("/")[0]
            import s3fs

            fs = s3fs.S3FileSystem(**options)
            fs.put(manifest, f"{bucket}/manifests/valid.tsv")
            manifest, out = f"s3://{bucket}/manifests/valid.tsv", url
            # credentials from the environment, as the example says; only the endpoint is overridden
            env.update(AWS_ACCESS_KEY_ID=options["key"], AWS_SECRET_ACCESS_KEY=options["secret"])
            overrides = [f"storage_options.client_kwargs.endpoint_url={moto.endpoint_url}"]
        else:
            overrides = []
        if conf.get("frontend", {}).get("type") == "model":
            # the example names the user's own class; a typo there is a config error (test below)
            overrides.append("frontend.model._target_=tests.orchestration.slow_model.SlowFramer")
        overrides += [f"manifests.{split}={manifest}" for split in conf["manifests"]] + [f"output_dir={out}"]
    proc = subprocess.run([sys.executable, f"flows/{job}.py", "--config", str(example), "--dry-run", *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "(dry run)" in proc.stdout and "to compute" in proc.stdout, proc.stdout
    backend = (conf.get("parallel") or {}).get("env", "local")
    assert f"  cluster: {backend}" in proc.stdout or f"  cluster: {backend}:" in proc.stdout, proc.stdout
    splits = conf["xvector"]["splits"] if "xvector" in conf else list(conf["manifests"])
    for split in splits:
        assert f"  {split}: " in proc.stdout, proc.stdout


def test_a_target_that_does_not_import_is_a_config_error_before_work(tmp_path, demo_corpus, session_api_url):
    env = cli_env(tmp_path / "home", api_url=session_api_url)
    # the GPU example with its frontend section replaced by your own module, as its comment says
    conf = yaml.safe_load((ROOT / "conf/stats_slurm_gpu.yaml").read_text())
    conf["frontend"] = {"type": "model", "model": {"_target_": "my_pkg.frontends.SSLFrontend"}, "device": "cuda"}
    config = tmp_path / "stats_slurm_gpu_model.yaml"
    config.write_text(yaml.safe_dump(conf))
    proc = subprocess.run([sys.executable, "flows/collect_stats.py", "--config", str(config),
                           f"manifests.train={demo_corpus['valid']}", f"output_dir={tmp_path / 'out'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: frontend.model._target_: cannot import 'my_pkg.frontends.SSLFrontend'"), \
        proc.stderr
    assert not (tmp_path / "out").exists()
