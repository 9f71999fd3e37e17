"""The flows' typed parameters (the Prefect UI form) and config resolution."""

from __future__ import annotations

import pytest

from espnet3_flows.config import ConfigError
from espnet3_flows.orchestration.entry import collect_stats, extract_xvectors, resolve_config


@pytest.mark.parametrize("flow", [collect_stats, extract_xvectors])
def test_parameter_schema_has_types_defaults_and_descriptions(flow):
    props = flow.parameters.model_dump()["properties"]
    assert props["parallel_env"]["default"] == "local"
    assert props["on_error"]["enum"] == ["fail", "skip"] or "anyOf" in props["on_error"] or "$ref" in str(props)
    assert props["shard_size"]["type"] == "integer"
    for name, spec in props.items():
        assert spec.get("description"), f"parameter {name} has no description in the UI form"


def test_precedence_defaults_file_params_overrides(tmp_path, demo_corpus):
    conf = tmp_path / "stats.yaml"
    conf.write_text(f"manifests:\n  valid: {demo_corpus['valid']}\nshard_size: 7\nbatch_size: 3\n")
    cfg = resolve_config("collect_stats", str(conf), {"batch_size": 5, "shard_size": 128}, ["on_error=skip"])
    assert cfg.shard_size == 7  # a parameter left at its default does not override the file
    assert cfg.batch_size == 5 and cfg.on_error == "skip"
    with pytest.raises(ConfigError, match="parallel.env"):
        resolve_config("collect_stats", str(conf), {"parallel.env": "slurmm"}, [])


def test_demo_corpus_when_no_manifest(tmp_path):
    cfg = resolve_config("collect_stats", None, {}, [f"output_dir={tmp_path}/exp/stats", "demo_utterances=10"])
    assert set(cfg.manifests) == {"train", "valid", "test"}
    assert (tmp_path / "exp" / "demo_data" / "train.tsv").is_file()
