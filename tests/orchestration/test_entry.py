"""The flows' typed parameters (the Prefect UI form) and config resolution."""

from __future__ import annotations

import pytest

from espnet3_flows.config import ConfigError
from espnet3_flows.orchestration.entry import job_flow, resolve_config
from espnet3_flows.stats.job import CollectStatsConfig


@pytest.mark.parametrize("job", ["collect_stats", "extract_xvectors"])
def test_parameter_schema_has_types_defaults_and_descriptions(job):
    flow = job_flow(job)
    props = flow.parameters.model_dump()["properties"]
    assert props["parallel_env"]["default"] == "local"
    assert props["on_error"]["enum"] == ["fail", "skip"] or "anyOf" in props["on_error"] or "$ref" in str(props)
    assert props["shard_size"]["type"] == "integer"
    for name, spec in props.items():
        assert spec.get("description"), f"parameter {name} has no description in the UI form"


def test_typed_parameter_defaults_are_the_config_defaults():
    """A parameter left at its default must mean the config's default (it is not passed on)."""
    import dataclasses
    import inspect

    from espnet3_flows.parallel.cluster import ParallelConfig
    from espnet3_flows.xvector.job import XVectorJobConfig

    stats, parallel = CollectStatsConfig(), ParallelConfig()
    xv = {f.name: f.default for f in dataclasses.fields(XVectorJobConfig)}  # it has no valid default instance
    collect_stats, extract_xvectors = job_flow("collect_stats"), job_flow("extract_xvectors")
    expected = {collect_stats: {"output_dir": stats.output_dir, "shard_size": stats.shard_size,
                                "batch_size": stats.batch_size, "on_error": stats.on_error,
                                "frontend_type": stats.frontend.type, "sampling_rate": stats.frontend.sampling_rate,
                                "num_mel_bins": stats.frontend.num_mel_bins,
                                "write_collected_feats": stats.write_collected_feats,
                                "parallel_env": stats.parallel.env, "n_workers": stats.parallel.n_workers},
                extract_xvectors: {"shard_size": xv["shard_size"], "on_error": xv["on_error"],
                                   "parallel_env": parallel.env, "n_workers": parallel.n_workers}}
    for flow, defaults in expected.items():
        params = inspect.signature(flow.fn).parameters
        for name, value in defaults.items():
            assert params[name].default == value, f"{flow.name}: {name} defaults to {params[name].default!r}, config to {value!r}"


def test_precedence_defaults_file_params_overrides(tmp_path, demo_corpus):
    conf = tmp_path / "stats.yaml"
    conf.write_text(f"manifests:\n  valid: {demo_corpus['valid']}\nshard_size: 7\nbatch_size: 3\n")
    cfg = resolve_config("collect_stats", str(conf), {"batch_size": 5, "shard_size": CollectStatsConfig.shard_size}, ["on_error=skip"])
    assert cfg.shard_size == 7  # a parameter left at its default does not override the file
    assert cfg.batch_size == 5 and cfg.on_error == "skip"
    with pytest.raises(ConfigError, match="parallel.env"):
        resolve_config("collect_stats", str(conf), {"parallel.env": "slurmm"}, [])


def test_demo_corpus_when_no_manifest(tmp_path):
    cfg = resolve_config("collect_stats", None, {}, [f"output_dir={tmp_path}/exp/stats", "demo_utterances=10"])
    assert set(cfg.manifests) == {"train", "valid", "test"}
    assert (tmp_path / "exp" / "demo_data" / "train.tsv").is_file()
