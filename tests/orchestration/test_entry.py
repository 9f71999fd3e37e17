"""The flows' typed parameters (the Prefect UI form) and config resolution."""

from __future__ import annotations

import dataclasses

import pytest

from espnet3_flows.config import ConfigError
from espnet3_flows.orchestration.entry import job_flow, resolve_config
from espnet3_flows.stats.job import CollectStatsConfig
from espnet3_flows.utterance_job import SplitsConfig

JOBS = ["collect_stats", "extract_xvectors", "extract_features"]


def _form_keys(schema: dict, node: dict, prefix: str = "") -> dict[str, dict]:
    """Dotted key → its field in the flow's parameter schema (sections opened)."""
    out = {}
    for name, spec in node["properties"].items():
        ref = spec.get("$ref") or next((s["$ref"] for s in spec.get("allOf", []) if "$ref" in s), None)
        if ref:
            out.update(_form_keys(schema, schema["definitions"][ref.rsplit("/", 1)[1]], f"{prefix}{name}."))
        else:
            out[prefix + name] = spec
    return out


@pytest.mark.parametrize("job", JOBS)
def test_the_form_has_every_config_key_with_its_default_and_description_but_no_credential(job):
    from omegaconf import OmegaConf

    from espnet3_flows.config import describe_keys
    from espnet3_flows.orchestration.jobs import get_job

    schema_class = get_job(job).config_class
    schema = job_flow(job).parameters.model_dump()
    form = _form_keys(schema, schema)
    hidden = {"storage_options", *getattr(schema_class, "CONFIG_ALIASES", {})}
    sections = {k.rsplit(".", 1)[0] for k in describe_keys(schema_class) if "." in k}
    expected = {k for k in describe_keys(schema_class)
                if k not in sections and not any(k == h or k.startswith(h + ".") for h in hidden)}
    assert set(form) == expected | {"config", "overrides"}
    assert not any(k.startswith("storage_options") for k in form)  # credentials never in the form
    defaults = OmegaConf.to_container(OmegaConf.structured(schema_class))
    for key in expected:
        value = defaults
        for part in key.split("."):
            value = value[part]
        assert form[key].get("default") == value, f"{job}: {key} defaults to {form[key].get('default')!r}, not {value!r}"
        assert form[key].get("description"), f"{job}: {key} has no description in the UI form"
    assert form["on_error"]["enum"] == ["fail", "skip"] and "slurm" in form["parallel.env"]["enum"]
    assert form["shard_size"]["type"] == "integer"


def _keys_with_choices(section: type, prefix: str = "") -> dict[str, tuple]:
    """Dotted key → the fixed values of every key of a config dataclass with ``choices``."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(section)
    out = {}
    for f in dataclasses.fields(section):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_keys_with_choices(hints[f.name], f"{prefix}{f.name}."))
        elif f.metadata.get("choices"):
            out[prefix + f.name] = tuple(f.metadata["choices"])
    return out


@pytest.mark.parametrize("job", JOBS)
def test_every_key_with_fixed_values_is_a_drop_down_of_exactly_them(job):
    from espnet3_flows.orchestration.jobs import get_job

    schema = job_flow(job).parameters.model_dump()
    form = _form_keys(schema, schema)
    choices = _keys_with_choices(get_job(job).config_class)
    for key, values in choices.items():
        assert form[key].get("enum") == list(values), f"{job}: {key} is no drop-down of {values}"
    engine = {"on_error", "fingerprint", "parallel.env"}
    own = {"collect_stats": {"frontend.type", "frontend.name", "collected_feats_format", "tokens.token_type"},
           "extract_features": {"frontend.type", "frontend.name"}, "extract_xvectors": {"xvector.toolkit"}}[job]
    assert engine | own <= set(choices)  # collected_feats_format, token_type: once free text
    if job == "collect_stats":
        assert form["tokens.token_type"]["enum"][:2] == ["", "none"] and "default" in form["frontend.name"]["enum"]


def test_section_parameters_set_only_the_keys_that_differ_from_their_defaults(tmp_path, demo_corpus):
    """The UI sends a whole section (every key filled with its default): only the changed keys
    are set, so a config file's other keys in that section stand."""
    from espnet3_flows.orchestration.parameters import dotted_values, form_fields

    conf = tmp_path / "stats.yaml"
    conf.write_text(f"manifests:\n  valid: {demo_corpus['valid']}\nparallel:\n  env: serial\n  n_workers: 3\n"
                    "frontend:\n  num_mel_bins: 40\n")
    fields = {f.name: f for f in form_fields(CollectStatsConfig)}
    parallel = fields["parallel"].annotation(env="slurm")  # what a filled form sends: n_workers=0 too
    frontend = fields["frontend"].default.model_copy(update={"dither": 0.5})
    values = dotted_values(CollectStatsConfig, {"parallel": parallel, "frontend": frontend, "shard_size": 9})
    cfg = resolve_config("collect_stats", str(conf), values, [])
    assert cfg.parallel.env == "slurm" and cfg.parallel.n_workers == 3  # changed in the form; the file's stands
    assert cfg.frontend.num_mel_bins == 40 and cfg.frontend.dither == 0.5  # the file's key stands beside it
    assert cfg.shard_size == 9 and cfg.manifests == {"valid": demo_corpus["valid"]}


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


def test_no_progress_bar_in_a_deployment_run_even_on_a_terminal(monkeypatch):
    import uuid

    from prefect.client.schemas.objects import FlowRun

    from espnet3_flows.orchestration.job_flow import show_progress

    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert show_progress(FlowRun(flow_id=uuid.uuid4()))  # python flows/<job>.py in a terminal
    assert not show_progress(FlowRun(flow_id=uuid.uuid4(), deployment_id=uuid.uuid4()))
    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    assert not show_progress(FlowRun(flow_id=uuid.uuid4()))  # output to a file or a pipe


def test_prefect_validates_the_form_and_a_typo_in_a_section_is_named(demo_corpus, tmp_path):
    """What a deployment run goes through: Prefect validates the parameters against the form
    (filling every section's defaults), and only the keys given reach the config."""
    from prefect.exceptions import ParameterTypeError, SignatureMismatchError

    from espnet3_flows.orchestration.parameters import dotted_values
    from espnet3_flows.xvector.job import XVectorJobConfig

    ecapa_dir = tmp_path / "model"  # the model is loaded later (preflight), not by the config
    flow = job_flow("extract_xvectors")
    given = {"manifests": {"valid": demo_corpus["valid"]}, "output_dir": str(tmp_path / "xv"),
             "xvector": {"pretrained_model": str(ecapa_dir)}, "parallel": {"env": "serial"}}
    values = flow.validate_parameters(given)
    cfg = resolve_config("extract_xvectors", None, dotted_values(XVectorJobConfig, values), [])
    assert cfg.xvector.pretrained_model == str(ecapa_dir) and cfg.parallel.env == "serial"
    assert cfg.output_dir == str(tmp_path / "xv") == cfg.xvector.save_path
    assert cfg.xvector.batch_size == 0 and cfg.shard_size == 128  # the rest: defaults
    with pytest.raises(ParameterTypeError, match="pretrained_modle"):
        flow.validate_parameters(given | {"xvector": {"pretrained_modle": "/m"}})
    with pytest.raises(SignatureMismatchError, match="storage_options"):  # credentials are no parameter
        flow.validate_parameters(given | {"storage_options": {"key": "AKIA..."}})


@pytest.mark.prefect
def test_a_credential_in_any_parameter_or_override_is_refused_naming_its_key(prefect_harness, demo_corpus, tmp_path):
    """What a deployment's run does with a credential in its parameters: the flow fails before any
    config is resolved or anything written, one line naming every key path (never the value)."""
    secret = "sEcReT-5d21-refused"
    flow = job_flow("collect_stats")
    given = {"manifests": {"valid": demo_corpus["valid"]}, "output_dir": str(tmp_path / "out"),
             "parallel": {"env": "serial", "options": {"env": {"AWS_SECRET_ACCESS_KEY": secret}}},
             "overrides": [f"parallel.options.connect_options.password={secret}", "shard_size=4"]}
    state = flow(**flow.validate_parameters(given), return_state=True)
    assert state.is_failed()
    message = str(state.message) + str(state.result(raise_on_failure=False))
    assert "flow parameters hold a credential (parallel.options.env.AWS_SECRET_ACCESS_KEY, " \
           "parallel.options.connect_options.password (in overrides))" in message, message
    assert secret not in message and not (tmp_path / "out").exists()


@pytest.mark.parametrize("switch", ["on", "off"])
def test_the_exit_after_a_lost_api_is_bounded_whatever_waits_for_it(tmp_path, switch):
    """Prefect's exit handlers try to deliver what they queue to an API that is gone (with every
    patch off its events drain was seen to wait forever): a command line whose run lost its API
    ends anyway, with the run's status and its error line, once LOST_API_EXIT_SECONDS are up. Here
    an exit handler that would wait ten minutes stands for the drain."""
    import subprocess
    import sys
    import time

    from espnet3_flows import patches

    code = ("import atexit, time, httpx\n"
            "from espnet3_flows.orchestration import entry\n"
            "entry.LOST_API_EXIT_SECONDS = 2.0\n"
            "atexit.register(time.sleep, 600)\n"
            "status = entry._report(httpx.ConnectError('All connection attempts failed'), verbose=False)\n"
            "entry.exit_now(status)\n")
    env = {**__import__("os").environ, patches.VAR: switch, "PREFECT_HOME": str(tmp_path),
           "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "error: the Prefect API at http://127.0.0.1:9/api stopped answering" in proc.stderr, proc.stderr
    assert time.monotonic() - started < 60  # not the handler's 600 s


@dataclasses.dataclass
class ConfigKeyedConfig(SplitsConfig):
    """A plugin job's config whose key ``config`` would hide the flow's ``config`` parameter."""

    config: str = "mine"


def test_a_job_whose_config_key_is_a_flow_parameter_is_refused_naming_it():
    from espnet3_flows.job_registry import JOBS as REGISTRY
    from espnet3_flows.job_registry import JobSpec

    REGISTRY.register("config_keyed", JobSpec("config_keyed", "config-keyed", "A job that names a key config.",
                                              f"{__name__}:ConfigKeyedConfig", "espnet3_flows.stats.job:collect_stats_runners"))
    try:
        with pytest.raises(TypeError, match=r"job 'config_keyed': its config key\(s\) config would hide the flow's"):
            job_flow("config_keyed")
    finally:
        REGISTRY.unregister("config_keyed")
