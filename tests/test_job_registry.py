"""The job registry: jobs declare themselves in their package; everything else discovers them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from espnet3_flows.config import ConfigError
from espnet3_flows.job_registry import JobSpec, available_jobs, get_job

ROOT = Path(__file__).resolve().parents[1]


def test_every_job_package_is_discovered_without_importing_job_code():
    code = ("import sys; from espnet3_flows.job_registry import available_jobs; "
            "print(','.join(available_jobs())); print('torch' in sys.modules, 'espnet3_flows.stats.job' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    names, heavy = out.splitlines()[0], out.splitlines()[1]
    assert names == "collect_stats,extract_features,extract_xvectors"
    assert heavy == "False False"  # specs name their code by "module:attribute"


def test_specs_resolve_and_unknown_jobs_name_the_known_ones():
    for name, spec in available_jobs().items():
        assert isinstance(spec, JobSpec) and spec.name == name
        assert callable(spec.load("runners")) and isinstance(spec.config_class, type)
        assert spec.load("preflight") is None or callable(spec.load("preflight"))
    with pytest.raises(ConfigError, match="collect_stats, extract_features, extract_xvectors"):
        get_job("collect_stat")


def test_no_job_name_in_orchestration():
    names = list(available_jobs())
    for path in (ROOT / "espnet3_flows" / "orchestration").glob("*.py"):
        text = path.read_text()
        for name in names:
            assert f'"{name}"' not in text and f"'{name}'" not in text, f"{path.name} names the job {name}"


def test_module_entry_lists_jobs_and_console_scripts_resolve():
    proc = subprocess.run([sys.executable, "-m", "espnet3_flows"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == ""  # a listing asked for: stdout (| less shows it)
    assert proc.stdout.startswith("usage: python -m espnet3_flows {")
    script = Path(sys.executable).with_name("espnet3-flows")  # the console script names itself
    listed = subprocess.run([str(script), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and listed.stdout.startswith("usage: espnet3-flows {"), listed.stdout + listed.stderr
    for name, spec in available_jobs().items():
        assert name in proc.stdout and spec.description in proc.stdout
    wrong = subprocess.run([sys.executable, "-m", "espnet3_flows", "collect-stat"], cwd=ROOT, capture_output=True,
                           text=True)
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert wrong.stderr.rstrip().endswith("error: unknown job 'collect-stat' (did you mean 'collect_stats'?)")
    from espnet3_flows import __main__ as entry

    assert callable(entry.collect_stats) and callable(entry.extract_features)
    with pytest.raises(AttributeError):
        entry.not_a_job  # noqa: B018


def test_every_packaged_job_has_a_console_script_and_a_deployment_entrypoint():
    import tomllib

    import espnet3_flows.flows
    from espnet3_flows.orchestration.entry import job_flow

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["espnet3-flows"] == "espnet3_flows.__main__:cli"
    packaged = [n for n, spec in available_jobs().items() if spec.schema.startswith("espnet3_flows.")]
    assert len(packaged) >= 3
    for name in packaged:
        assert scripts[f"espnet3-{name.replace('_', '-')}"] == f"espnet3_flows.__main__:{name}"
        assert getattr(espnet3_flows.flows, name) is job_flow(name)  # entrypoint: espnet3_flows.flows.<job>
    assert sorted(dir(espnet3_flows.flows)) == sorted(available_jobs())
    with pytest.raises(AttributeError, match="jobs: "):
        espnet3_flows.flows.not_a_job  # noqa: B018


def test_every_jobs_runner_is_a_split_runner_and_errors_share_one_root(tmp_path, demo_corpus):
    from espnet3_flows import errors
    from espnet3_flows.config import ConfigError, load_config
    from espnet3_flows.inputs.records import ManifestError
    from espnet3_flows.errors import ItemError, ShardFailure
    from espnet3_flows.storage import StorageError
    from espnet3_flows.utterance_job import SplitRunner

    for name, spec in available_jobs().items():
        if name == "extract_xvectors":  # needs a model; its runner class is checked below
            continue
        cfg = load_config(spec.config_class, overrides=[f"manifests.valid={demo_corpus['valid']}",
                                                        f"output_dir={tmp_path / name}"])
        (runner,) = spec.build_runners(cfg)
        assert isinstance(runner, SplitRunner), name
    from espnet3_flows.xvector.job import XVectorRunner

    assert all(hasattr(XVectorRunner, m) for m in ("plan", "merge", "run_shard", "manifest_skipped", "outputs_rel"))
    for cls in (ConfigError, ManifestError, StorageError, ItemError, ShardFailure, errors.BadItemError):
        assert issubclass(cls, errors.Espnet3FlowsError), cls
    assert issubclass(ConfigError, ValueError) and issubclass(errors.BadItemError, ValueError)  # as before
