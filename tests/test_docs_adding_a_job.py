"""docs/adding-a-job.md shows what a job's files are, not an older form of them: its flow file is
``flows/collect_stats.py`` with the job's name changed, its deployment entry has the fields and the
entrypoint form of ``deployments/prefect.yaml``, and the entrypoint it names resolves."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "adding-a-job.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_flow_file_is_the_real_one_with_another_name():
    shown = _blocks("python")[-1]  # section 2's flow file
    real = (ROOT / "flows" / "collect_stats.py").read_text()
    as_features = real.replace("collect_stats", "extract_features").replace("Collect-stats", "Extract-features")
    # (the demo remark of the real file's first line is collect-stats' own)
    assert shown.splitlines()[1:] == as_features.splitlines()[1:]
    assert shown.splitlines()[0] == as_features.splitlines()[0].replace(" (no args: demo data)", "")


def test_the_deployment_entry_matches_prefect_yaml():
    shown = yaml.safe_load(_blocks("yaml")[-1].replace("*tags", "tags").replace("*espnet3_pool", "pool"))[0]
    real = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    ours = next(d for d in real["deployments"] if d["name"] == shown["name"])
    assert shown["entrypoint"] == ours["entrypoint"] == "espnet3_flows.flows.extract_features"
    assert set(shown) == set(ours) - {"schedules", "schedule"}
    import espnet3_flows.flows

    assert espnet3_flows.flows.extract_features.name  # the entrypoint resolves to a flow
