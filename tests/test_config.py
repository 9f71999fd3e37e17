"""Job configuration: defaults, YAML and overrides in order, clear errors naming the key, CLI splitting."""

from __future__ import annotations

import json

import pytest

from espnet3_flows.config import ConfigError, load_config, split_cli_args, to_plain
from espnet3_flows.parallel.parallel_config import ParallelConfig
from espnet3_flows.stats import CollectStatsConfig, FrontendConfig


def test_defaults_and_typed_overrides():
    cfg = load_config(CollectStatsConfig, overrides=[
        "shard_size=64", "frontend.num_mel_bins=40", "frontend.channel=1", "manifests.train=/d/train.tsv",
        "parallel.env=serial", "write_collected_feats=true", "storage_options.anon=true"])
    assert isinstance(cfg, CollectStatsConfig)
    assert isinstance(cfg.frontend, FrontendConfig) and isinstance(cfg.parallel, ParallelConfig)
    assert cfg.shard_size == 64 and cfg.frontend.num_mel_bins == 40 and cfg.frontend.channel == 1
    assert cfg.manifests == {"train": "/d/train.tsv"} and cfg.parallel.env == "serial"
    assert cfg.write_collected_feats is True and cfg.storage_options == {"anon": True}
    assert cfg.batch_size == CollectStatsConfig().batch_size and cfg.frontend.type == "fbank"
    assert type(cfg.manifests) is dict  # plain containers, not OmegaConf nodes
    json.dumps(to_plain(cfg))


def test_sources_in_order_defaults_base_file_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("shard_size: 32\nbatch_size: 4\nfrontend:\n  num_mel_bins: 64\nparallel:\n  env: serial\n")
    cfg = load_config(CollectStatsConfig, path, overrides=["batch_size=2"],
                      base={"shard_size": 8, "on_error": "skip", "batch_size": 99})
    assert cfg.shard_size == 32  # the file beats base
    assert cfg.batch_size == 2  # overrides beat the file
    assert cfg.on_error == "skip"  # base beats the defaults
    assert cfg.frontend.num_mel_bins == 64 and cfg.frontend.frame_shift == 0.01


def test_params_go_between_the_file_and_the_overrides_and_replace_mappings(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("manifests:\n  train: /d/train.tsv\n  valid: /d/valid.tsv\nshard_size: 32\n")
    cfg = load_config(CollectStatsConfig, path, overrides=["shard_size=4"],
                      params={"manifests": {"test": "/d/test.tsv"}, "shard_size": 16, "parallel.env": "serial"})
    assert cfg.manifests == {"test": "/d/test.tsv"}  # the parameter's manifests, not merged into the file's
    assert cfg.shard_size == 4 and cfg.parallel.env == "serial"
    with pytest.raises(ConfigError, match="shard_size"):
        load_config(CollectStatsConfig, params={"shard_size": "many"})
    with pytest.raises(ConfigError, match="shard_sise"):
        load_config(CollectStatsConfig, params={"shard_sise": 3})


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="shard_sise"):
        load_config(CollectStatsConfig, overrides=["shard_sise=3"])
    with pytest.raises(ConfigError, match=r"frontend\.num_mel"):
        load_config(CollectStatsConfig, overrides=["frontend.num_mel=3"])


def test_unknown_key_in_a_file_is_named(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("frontend:\n  samplingrate: 8000\n")
    with pytest.raises(ConfigError, match=r"frontend\.samplingrate"):
        load_config(CollectStatsConfig, path)


@pytest.mark.parametrize("override,key", [
    ("shard_size=abc", "shard_size"),
    ("frontend.dither=loud", "frontend.dither"),
    ("write_collected_feats=maybe", "write_collected_feats"),
    ("manifests=3", "manifests"),
])
def test_wrong_type_is_an_error(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(CollectStatsConfig, overrides=[override])


def test_bad_parallel_env_suggests_the_closest():
    with pytest.raises(ConfigError) as info:
        load_config(CollectStatsConfig, overrides=["parallel.env=slurmm"])
    msg = str(info.value)
    assert "parallel.env" in msg and "'slurmm'" in msg and "did you mean 'slurm'" in msg
    assert "serial" in msg and "local" in msg  # and the valid choices


@pytest.mark.parametrize("override,match", [
    ("on_error=ignore", "on_error must be one of"),
    ("shard_size=0", "shard_size must be >= 1"),
    ("batch_size=0", "batch_size must be >= 1"),
    ("frontend.type=mfcc", "frontend.type: unknown frontend .mfcc."),
    ("frontend.type=model", r"frontend\.model\._target_"),
    ("frontend.max_duration=0", "max_duration must be positive"),
    ("manifests.a/b=/a.tsv", "split name 'a/b'"),
    ("manifests.-x=/a.tsv", "split name '-x'"),
    ("parallel.n_workers=-1", "n_workers"),
])
def test_validation_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(CollectStatsConfig, overrides=[override])


def test_bad_overrides_and_files(tmp_path):
    with pytest.raises(ConfigError, match="'shard_size' is not of the form key=value"):
        load_config(CollectStatsConfig, overrides=["shard_size"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(CollectStatsConfig, tmp_path / "nope.yaml")
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(CollectStatsConfig, listing)


def test_split_cli_args():
    assert split_cli_args([]) == (None, [])
    assert split_cli_args(["--config", "a.yaml", "x=1", "y.z=2"]) == ("a.yaml", ["x=1", "y.z=2"])
    assert split_cli_args(["x=1", "-c", "b.yaml"]) == ("b.yaml", ["x=1"])
    assert split_cli_args(["--config=c.yaml", "k=a=b"]) == ("c.yaml", ["k=a=b"])
    with pytest.raises(ConfigError, match="--config needs a file"):
        split_cli_args(["--config"])
    with pytest.raises(ConfigError, match="unexpected argument '--shard_size'"):
        split_cli_args(["--shard_size", "3"])
    with pytest.raises(ConfigError, match="unexpected argument 'positional'"):
        split_cli_args(["positional"])
    with pytest.raises(ConfigError, match="unexpected argument '--x=1'"):
        split_cli_args(["--x=1"])


def test_targets_are_built_by_hydra_as_in_espnet3():
    import functools

    from espnet3_flows.config import check_targets, instantiate

    spec = {"_target_": "collections.OrderedDict", "_args_": [[["a", 1], ["b", 2]]]}
    assert list(instantiate(spec).items()) == [("a", 1), ("b", 2)]  # positional _args_
    partial = instantiate({"_target_": "fractions.Fraction", "_partial_": True, "numerator": 3})
    assert isinstance(partial, functools.partial) and partial(denominator=4) == 0.75
    nested = instantiate({"_target_": "builtins.dict", "parts": [{"_target_": "fractions.Fraction", "numerator": 1,
                                                                  "denominator": 2}, 5]})
    assert nested["parts"][0] == 0.5 and type(nested["parts"]) is list  # targets in lists, plain containers
    with pytest.raises(ConfigError, match=r"^frontend\.model: .*fractions\.Fraction"):
        instantiate({"_target_": "fractions.Fraction", "numerator": "x"}, "frontend.model")
    with pytest.raises(ConfigError, match=r"frontend\.model\.layers\[1\]\._target_: cannot import 'no_such\.Layer'"):
        check_targets({"_target_": "builtins.dict", "layers": [{"_target_": "builtins.list"},
                                                               {"_target_": "no_such.Layer"}]}, "frontend.model")


def _on_error_message(call) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    return str(info.value)


def test_on_error_is_checked_by_one_function_everywhere_a_policy_is_given(tmp_path):
    """The config, a runner and the planners refuse an unknown policy with the same message
    (one check, :func:`check_on_error`), instead of taking it for ``skip``."""
    from espnet3_flows.inputs.kaldi_dir import join_data_dir
    from espnet3_flows.inputs.manifest import read_manifest
    from espnet3_flows.inputs.planner import plan_manifest
    from espnet3_flows.parallel.base_runner import BaseRunner

    manifest = tmp_path / "m.tsv"
    manifest.write_text("u1\t/a.wav\n")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "wav.scp").write_text("u1 /a.wav\n")
    expected = "on_error must be one of ('fail', 'skip'), got 'skipp' (did you mean 'skip'?)"
    messages = {
        "config": _on_error_message(lambda: load_config(CollectStatsConfig, overrides=["on_error=skipp"])),
        "runner": _on_error_message(lambda: BaseRunner(None, on_error="skipp")),
        "read_manifest": _on_error_message(lambda: read_manifest(str(manifest), "train", on_error="skipp")),
        "plan_manifest": _on_error_message(lambda: plan_manifest(str(manifest), "train", 4, {}, on_error="skipp")),
        "join_data_dir": _on_error_message(lambda: join_data_dir(str(tmp_path / "d"), "train", None, on_error="skipp")),
    }
    assert all(msg.endswith(expected) for msg in messages.values()), messages


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:0", "cuda:1", "cuda:10"])
def test_device_names_torch_accepts_are_accepted(name):
    import torch

    from espnet3_flows.config import check_device

    assert check_device(name) == name
    torch.device(name)  # what the worker does with it


@pytest.mark.parametrize("name", ["cuda:01", "cuda:00", "cuda:", "cuda:-1", "cuda:+1", "cuda:x", "cuda:1.5",
                                  "cuda:\u0663", " cuda", "cuda:0 ", "CUDA", "", "mps", "cpu:0", None,
                                  pytest.param("gpu", id="word-gpu")])  # an id "gpu" would mark it a GPU test
def test_bad_device_names_are_refused_alike_by_every_job_and_the_model_loader(name):
    """One check (:func:`check_device`) for ``frontend.device``, ``xvector.device`` and the
    x-vector model loader; ``cuda:01`` is refused as ``torch.device`` refuses it, and the device
    types the jobs do not run models on (``mps``) are refused with the forms they take."""
    import torch

    from espnet3_flows.config import check_device
    from espnet3_flows.xvector.job import XVectorJobConfig
    from espnet3_flows.xvector.model import validate_device

    if name and name.startswith("cuda"):
        with pytest.raises(RuntimeError):
            torch.device(name)  # torch refuses these spellings too
    forms = "must be 'cpu', 'cuda' or 'cuda:N'"
    with pytest.raises(ConfigError, match=f"^device {forms}"):
        check_device(name)
    with pytest.raises(ValueError, match=forms):
        validate_device(name)
    if name is None:
        return
    with pytest.raises(ConfigError, match=f"frontend.device {forms}"):
        load_config(CollectStatsConfig, params={"frontend.type": "model", "frontend.device": name,
                                                "frontend.model": {"_target_": "torch.nn.Identity"}})
    with pytest.raises(ConfigError, match=f"xvector.device {forms}"):
        load_config(XVectorJobConfig, params={"manifests": {"train": "/d/train.tsv"}, "xvector.device": name,
                                              "xvector.toolkit": "custom",
                                              "xvector.model": {"_target_": "torch.nn.Identity"}})


@pytest.mark.parametrize("override, hint", [
    ("parallel.nworkers=2", "parallel.nworkers: Key 'nworkers' not in 'ParallelConfig' (did you mean 'n_workers'?)"),
    ("shard_sise=2", "(did you mean 'shard_size'?)"),
    ("frontend.typ=fbank", "(did you mean 'type'?)"),
])
def test_an_unknown_key_gets_the_closest_key(override, hint):
    from espnet3_flows.config import load_config
    from espnet3_flows.stats.job import CollectStatsConfig

    with pytest.raises(ConfigError) as err:
        load_config(CollectStatsConfig, overrides=[override])
    assert hint in str(err.value)


def test_an_unknown_key_with_nothing_close_gets_no_guess():
    from espnet3_flows.config import load_config
    from espnet3_flows.stats.job import CollectStatsConfig

    with pytest.raises(ConfigError) as err:
        load_config(CollectStatsConfig, overrides=["zzz=1"])
    assert "did you mean" not in str(err.value)
