"""A lab's own package extends the product without editing it: ``tests/support/lab_plugin_package``
(a job, a manifest format, a frontend, an x-vector toolkit and a cluster backend: one entry point
of each group) is installed with pip, and the command line runs all five."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import kaldiio
import numpy as np
import pytest
import soundfile as sf

from tests.support.servers import cli_env

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tests" / "support" / "lab_plugin_package"
pytestmark = [pytest.mark.prefect, pytest.mark.dask, pytest.mark.slow]


def _pip_install(source: Path, target: Path) -> None:
    """Install ``source`` into ``target`` as a user's ``pip install`` would, offline."""
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                           "--no-build-isolation", "--target", str(target), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def plugins(tmp_path_factory) -> Path:
    """The lab's package installed in a directory of its own (the test's ``site-packages``)."""
    work = tmp_path_factory.mktemp("lab")
    shutil.copytree(PACKAGE, work / "src")  # (a build writes beside its sources: not into the checkout)
    _pip_install(work / "src", work / "site")
    assert sorted(p.name for p in (work / "site").glob("*.dist-info")) == ["lab_plugins-0.1.0.dist-info"]
    return work / "site"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """Six utterances of noise in a ``.pipes`` manifest (the plugin's format), two speakers."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(7)
    waves, lines = {}, []
    for i in range(6):
        wave = (rng.standard_normal(16000 + 800 * i) * (0.05 + 0.02 * i)).astype(np.float32)
        sf.write(root / f"u{i}.wav", wave, 16000, subtype="FLOAT")
        waves[f"spk{i % 2}-u{i}"] = wave
        lines.append(f"spk{i % 2}-u{i}|{root / f'u{i}.wav'}")
    (root / "train.pipes").write_text("# id|path\n" + "\n".join(lines) + "\n")
    return root / "train.pipes", waves


def _run(args: list[str], site: Path, home: Path, cwd: Path, api_url: str | None = None) -> subprocess.CompletedProcess:
    """The CLI with the plugins installed in ``site``; against the server ``api_url`` if given."""
    env = cli_env(home / "prefect-home", DO_NOT_TRACK="1", api_url=api_url)
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    return subprocess.run([sys.executable, "-m", "espnet3_flows", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_a_plugin_format_frontend_and_backend_run_collect_stats(plugins, corpus, tmp_path, session_api_url):
    manifest, waves = corpus
    out = tmp_path / "stats"
    args = ["collect_stats", f"manifests.train={manifest}", "frontend.type=log_energy", "frontend.conf.frame=320",
            "parallel.env=lab_processes", "parallel.n_workers=1", "shard_size=2", f"output_dir={out}"]
    plan = _run([*args, "--dry-run"], plugins, tmp_path, tmp_path)
    assert plan.returncode == 0, plan.stderr[-4000:]
    assert "cluster: lab_processes: lab_plugins.backends.process_cluster(" in plan.stdout
    assert "train: 6 utterances in 3 shard(s)" in plan.stdout
    proc = _run(args, plugins, tmp_path, tmp_path, session_api_url)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "train: 6 utterances, 6.8 s of audio, shards computed 3" in proc.stdout
    # the statistics of the features the plugin defines, computed here on their own
    energies = [np.log((w[: len(w) // 320 * 320].astype(np.float64).reshape(-1, 320) ** 2).sum(axis=1) + 1e-10)
                for w in waves.values()]
    stats = np.load(out / "train" / "feats_stats.npz")
    assert int(stats["count"]) == sum(len(e) for e in energies)
    np.testing.assert_allclose(stats["sum"], [sum(e.sum() for e in energies)], rtol=1e-5)
    np.testing.assert_allclose(stats["sum_square"], [sum((e ** 2).sum() for e in energies)], rtol=1e-5)
    shapes = dict(line.split() for line in (out / "train" / "feats_shape").read_text().splitlines())
    assert shapes == {k: f"{len(w) // 320},1" for k, w in waves.items()}


def test_a_plugin_toolkit_format_and_backend_run_extract_xvectors(plugins, corpus, tmp_path, session_api_url):
    manifest, waves = corpus
    out = tmp_path / "xv"
    proc = _run(["extract_xvectors", f"manifests.train={manifest}", "xvector.toolkit=mean_std",
                 "parallel.env=lab_processes", "parallel.n_workers=1", f"output_dir={out}"], plugins, tmp_path,
                tmp_path, session_api_url)
    assert proc.returncode == 0, proc.stderr[-4000:]
    embeddings = dict(kaldiio.load_scp_sequential(str(out / "xvector" / "train" / "xvector.scp")))
    assert sorted(embeddings) == sorted(waves)
    for key, wave in waves.items():
        np.testing.assert_allclose(embeddings[key], [wave.mean(), wave.std(ddof=1)], rtol=1e-4, atol=1e-6)
    summary = json.loads((out / "xvector" / "train" / "summary.json").read_text())
    assert summary["utterances"] == 6


def test_a_plugin_job_runs_from_the_command_line(plugins, corpus, tmp_path, session_api_url):
    """The lab's own job (``espnet3_flows.jobs``) on its own format and backend: listed by
    ``--help``, run by ``python -m espnet3_flows peak_levels``, its outputs each utterance's peak."""
    manifest, waves = corpus
    listed = _run(["--help"], plugins, tmp_path, tmp_path)
    assert listed.returncode == 0 and "peak_levels" in listed.stdout, listed.stdout[-2000:]
    out = tmp_path / "peaks"
    proc = _run(["peak_levels", f"manifests.train={manifest}", "parallel.env=lab_processes", "parallel.n_workers=1",
                 "shard_size=2", f"output_dir={out}"], plugins, tmp_path, tmp_path, session_api_url)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split("\t") for line in (out / "train" / "peaks.tsv").read_text().splitlines()]
    assert [utt for utt, _ in rows] == sorted(waves)
    for utt, peak in rows:
        assert float(peak) == float(np.abs(waves[utt]).max())  # float32 samples, read back exactly
    summary = json.loads((out / "train" / "summary.json").read_text())
    assert summary["utterances"] == 6 and summary["shards_computed"] == summary["shards"] == 3


def test_plugin_names_are_offered_and_suggested(plugins, tmp_path):
    proc = _run(["collect_stats", "--dry-run", "frontend.type=log_energi", f"output_dir={tmp_path}/o"], plugins,
                tmp_path, tmp_path)
    assert proc.returncode == 2 and "did you mean 'log_energy'" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "o").exists()
    code = textwrap.dedent("""
        import json
        from espnet3_flows.frontends.frontend import FrontendConfig
        from espnet3_flows.orchestration.parameters import section_model
        from espnet3_flows.parallel.parallel_config import ParallelConfig
        from espnet3_flows.xvector.job import XVectorConfig
        print(json.dumps([json.dumps(section_model(c).model_json_schema())
                          for c in (FrontendConfig, XVectorConfig, ParallelConfig)]))
    """)
    env = cli_env(tmp_path / "home")
    env["PYTHONPATH"] = f"{plugins}:{env['PYTHONPATH']}"
    schemas = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                        check=True).stdout)
    # the UI's drop-downs list the installed plugins' names beside the built-in ones
    for schema, (plugin, builtin) in zip(schemas, [("log_energy", "fbank"), ("mean_std", "speechbrain"),
                                                   ("lab_processes", "slurm")], strict=True):
        assert f'"{plugin}"' in schema and f'"{builtin}"' in schema


def test_a_broken_or_clashing_plugin_is_one_clear_error(tmp_path):
    src = tmp_path / "src"
    (src / "broken_plugins").mkdir(parents=True)
    (src / "broken_plugins" / "__init__.py").write_text("")
    (src / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "broken-plugins"
        version = "1.0"
        [tool.setuptools]
        packages = ["broken_plugins"]
        [project.entry-points."espnet3_flows.frontends"]
        fbank = "broken_plugins:nothing"
        missing = "broken_plugins.not_there:Frontend"
    """))
    _pip_install(src, tmp_path / "site")
    proc = _run(["collect_stats", "--dry-run", "frontend.type=missing", f"output_dir={tmp_path}/o"],
                tmp_path / "site", tmp_path, tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("entry point missing = broken_plugins.not_there:Frontend (espnet3_flows.frontends, from broken-plugins) "
            "cannot be used: ModuleNotFoundError") in proc.stderr
    assert "Traceback" not in proc.stderr
    # the built-in fbank is not replaced: a dry run with it plans as always
    proc = _run(["collect_stats", "--dry-run", f"output_dir={tmp_path}/o2"], tmp_path / "site", tmp_path, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_plugin_docs_show_the_tested_package():
    """``docs/plugins.md`` quotes each file of the package these tests install, unchanged."""
    doc = (ROOT / "docs" / "plugins.md").read_text()
    quoted = 0
    for path in sorted(p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".toml") and p.name != "__init__.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        lang = "toml" if path.suffix == ".toml" else "python"
        assert f"`{rel}`:\n\n```{lang}\n{path.read_text().rstrip()}\n```\n" in doc, f"{rel} is not quoted as it is"
        quoted += 1
    assert quoted == 6
