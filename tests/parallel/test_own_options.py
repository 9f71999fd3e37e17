"""A placement's own options (``espnet3_flows.parallel.backends.own_options``): read from
``parallel.options``, typed, kept from the cluster class; their old top-level spellings still read."""

from __future__ import annotations

import pytest

from espnet3_flows.config import ConfigError, load_config
from espnet3_flows.parallel.backends.address import RunningScheduler
from espnet3_flows.parallel.backends.cluster_setup import WorkerMemory
from espnet3_flows.parallel.backends.jobqueue import TRIM_VAR
from espnet3_flows.parallel.backends.local import LocalOptions
from espnet3_flows.parallel.cluster import cluster_spec
from espnet3_flows.parallel.parallel_config import MOVED_KEYS, ParallelConfig
from espnet3_flows.stats.config import CollectStatsConfig

OWN = {"start_method": "spawn", "inline_shards": 0, "trim_worker_memory": True}


def test_each_env_reads_its_own_options_typed():
    assert ParallelConfig(env="local").placement_options == LocalOptions()
    assert ParallelConfig(env="local", options=OWN).placement_options == LocalOptions(**OWN)
    assert ParallelConfig(env="slurm", options={"trim_worker_memory": True}).placement_options == WorkerMemory(True)
    running = ParallelConfig(env="address", options={"address": "tcp://h:1"})
    assert running.placement_options == RunningScheduler("tcp://h:1")
    assert ParallelConfig(env="serial").placement_options is None


@pytest.mark.parametrize("key, value, needs", [("inline_shards", "2", "an integer"),
                                               ("inline_shards", True, "an integer"),
                                               ("trim_worker_memory", "yes", "true or false"),
                                               ("start_method", 1, "a string")])
def test_an_option_of_the_wrong_type_names_its_key_and_type(key, value, needs):
    with pytest.raises(ConfigError, match=rf"parallel.options.{key} must be {needs} for parallel.env=local, got"):
        ParallelConfig(env="local", options={key: value})


def test_an_option_s_own_checks_run():
    with pytest.raises(ConfigError, match=r"parallel.options.start_method must be one of \('forkserver', 'spawn'\)"):
        ParallelConfig(env="local", options={"start_method": "fork"})
    with pytest.raises(ConfigError, match="parallel.options.inline_shards must be >= 0"):
        ParallelConfig(env="local", options={"inline_shards": -1})


def test_an_env_s_own_options_are_not_given_to_its_cluster():
    spec = cluster_spec(ParallelConfig(env="local", n_workers=1, options={**OWN, "memory_limit": "1GB"}))
    assert spec.kwargs["memory_limit"] == "1GB" and not set(OWN) & set(spec.kwargs)
    kept = cluster_spec(ParallelConfig(env="slurm", options={"trim_worker_memory": True}))
    trimmed = cluster_spec(ParallelConfig(env="slurm"))
    assert "trim_worker_memory" not in kept.kwargs
    assert not any(TRIM_VAR in line for line in kept.kwargs.get("job_script_prologue", []))
    assert any(TRIM_VAR in line for line in trimmed.kwargs["job_script_prologue"])


def test_an_option_another_env_owns_is_the_cluster_s_and_refused_by_name():
    with pytest.raises(ConfigError, match=r"parallel.options.start_method: not an option of dask_jobqueue.SLURM"):
        ParallelConfig(env="slurm", options={"start_method": "spawn"})


def test_the_old_spellings_read_as_the_new_keys_from_every_source(tmp_path):
    """A file, an override and a job's root all read ``parallel.<old>`` as its new key; the old and
    new spelling with two values is an error naming both."""
    expected = ParallelConfig(env="local", options=OWN)
    assert load_config(ParallelConfig, base=dict(OWN)) == expected
    config = tmp_path / "c.yaml"
    config.write_text("parallel:\n  inline_shards: 0\n  start_method: spawn\n  options: {memory_limit: 1GB}\n")
    job = load_config(CollectStatsConfig, config, overrides=["parallel.trim_worker_memory=true"])
    assert job.parallel.options == {**OWN, "memory_limit": "1GB"}
    from_params = load_config(CollectStatsConfig, params={"parallel.inline_shards": 0})
    assert from_params.parallel.options == {"inline_shards": 0}
    with pytest.raises(ConfigError, match="parallel.options.inline_shards and parallel.inline_shards are the same key"):
        load_config(CollectStatsConfig, overrides=["parallel.options.inline_shards=2", "parallel.inline_shards=3"])
    assert set(MOVED_KEYS) == {"trim_worker_memory", "start_method", "inline_shards", "address", "scheduler_file",
                               "cluster_class"}


def test_a_deployment_s_saved_parameters_with_an_old_spelling_still_validate():
    """The flow's form (a pydantic model of the section) reads the old keys too: parameters saved in
    a deployment before the keys moved do not fail their run's validation."""
    from espnet3_flows.orchestration.parameters import dotted_values, section_model

    form = section_model(ParallelConfig, "parallel.")
    assert "inline_shards" not in form.model_fields  # the form shows only the new keys
    saved = form.model_validate({"env": "local", "inline_shards": 0, "options": {"memory_limit": "1GB"}})
    assert saved.options == {"memory_limit": "1GB", "inline_shards": 0}
    assert dotted_values(CollectStatsConfig, {"parallel": {"start_method": "spawn"}}) == {
        "parallel.options": {"start_method": "spawn"}}
