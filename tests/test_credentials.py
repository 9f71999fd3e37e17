"""The one rule of what is a credential (espnet3_flows.credentials), in every section of a config."""

from __future__ import annotations

import copy

import pytest

from espnet3_flows.config import ConfigError
from espnet3_flows.credentials import (
    MASK,
    find_secrets,
    has_secrets,
    is_secret_key,
    mask_secrets,
    redact,
    refuse_secrets,
    secrets_in_overrides,
)
from espnet3_flows.orchestration.jobs import resolve_config
from espnet3_flows.stats.job import CollectStatsConfig

SECRET = "sEcReT-0b7e-do-not-show"


@pytest.mark.parametrize("name", ["secret", "key", "token", "password", "passphrase", "client_keys", "pkcs11_pin",
                                  "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "HF_TOKEN",
                                  "PGPASSWORD", "OPENAI_API_KEY", "GOOGLE_APPLICATION_CREDENTIALS",
                                  "PREFECT_API_AUTH_STRING", "session_token"])
def test_names_of_credentials_are_secret(name):
    assert is_secret_key(name)


@pytest.mark.parametrize("name", ["endpoint_url", "AWS_ENDPOINT_URL_S3", "region_name", "profile", "hosts",
                                  "known_hosts", "username", "AWS_DEFAULT_REGION", "queue", "image"])
def test_other_names_are_not(name):
    assert not is_secret_key(name)


def _config(**extra: str) -> CollectStatsConfig:
    overrides = ["manifests.valid=/data/wav.scp", "output_dir=/tmp/out", "parallel.env=ssh",
                 "parallel.options.hosts=[head,node1]", f"parallel.options.connect_options.password={SECRET}",
                 f"parallel.options.connect_options.passphrase={SECRET}",
                 "parallel.options.connect_options.client_keys=[/home/u/.ssh/id_ed25519]",
                 "parallel.options.connect_options.username=u",
                 f"parallel.options.worker_options.env.AWS_SECRET_ACCESS_KEY={SECRET}",
                 "parallel.options.worker_options.env.AWS_ENDPOINT_URL_S3=http://127.0.0.1:9000",
                 f"storage_options.secret={SECRET}", "storage_options.client_kwargs.endpoint_url=http://127.0.0.1:9000",
                 "tokens.token_type=char", "tokens.token_list=/data/tokens.txt"]
    return resolve_config("collect_stats", None, {}, overrides + [f"{k}={v}" for k, v in extra.items()])


def test_every_section_is_masked_and_the_config_kept():
    cfg = _config()
    before = copy.deepcopy(cfg)
    shown = mask_secrets(cfg)
    assert SECRET not in repr(shown)
    connect = shown["parallel"]["options"]["connect_options"]
    assert connect["password"] == connect["passphrase"] == connect["client_keys"] == MASK
    assert connect["username"] == "u" and shown["parallel"]["options"]["hosts"] == ["head", "node1"]
    env = shown["parallel"]["options"]["worker_options"]["env"]
    assert env == {"AWS_SECRET_ACCESS_KEY": MASK, "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9000"}
    assert shown["storage_options"] == {"secret": MASK, "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}
    # a tokenizer's settings are named like credentials but declared none; the section is judged key by key
    assert shown["tokens"]["token_type"] == "char" and shown["tokens"]["token_list"] == "/data/tokens.txt"
    assert cfg == before  # the driver keeps the real values (the workers receive them)
    assert find_secrets(cfg) == ["storage_options.secret", "parallel.options.connect_options.password",
                                 "parallel.options.connect_options.passphrase",
                                 "parallel.options.connect_options.client_keys",
                                 "parallel.options.worker_options.env.AWS_SECRET_ACCESS_KEY"]


def test_plain_data_lists_and_prologue_lines():
    options = {"job_script_prologue": ["module load cuda", f"export AWS_SECRET_ACCESS_KEY={SECRET}",
                                       "export AWS_DEFAULT_REGION=us-east-1"],
               "env": {"HF_TOKEN": SECRET, "MASKED_TOKEN": MASK, "EMPTY_KEY": "", "REF_KEY": "${oc.env:REF_KEY}"},
               "kbdint_auth": False, "password": None}
    shown = redact(options)
    assert shown["job_script_prologue"] == ["module load cuda", f"export AWS_SECRET_ACCESS_KEY={MASK}",
                                            "export AWS_DEFAULT_REGION=us-east-1"]
    # masked, empty or a reference to the worker's environment: nothing to hide, nothing refused
    assert shown["env"] == {"HF_TOKEN": MASK, "MASKED_TOKEN": MASK, "EMPTY_KEY": "", "REF_KEY": "${oc.env:REF_KEY}"}
    assert shown["kbdint_auth"] is False and shown["password"] is None
    assert find_secrets(options) == ["job_script_prologue[1] (AWS_SECRET_ACCESS_KEY)", "env.HF_TOKEN"]
    assert has_secrets(options) and not has_secrets(shown) and not has_secrets(None)


def test_overrides_and_parameters_are_judged_against_the_schema():
    assert secrets_in_overrides(["tokens.token_list=/data/tokens.txt", "shard_size=4",
                                 "storage_options.client_kwargs.endpoint_url=http://x",
                                 "parallel.options.env.AWS_SECRET_ACCESS_KEY=${oc.env:AWS_SECRET_ACCESS_KEY}"],
                                CollectStatsConfig) == []
    assert secrets_in_overrides([f"parallel.options.env.AWS_SECRET_ACCESS_KEY={SECRET}",
                                 f"storage_options={{key: AKIA, secret: {SECRET}}}",
                                 f"parallel.options.connect_options.password='{SECRET}"],  # not valid YAML: still found
                                CollectStatsConfig) == [
        "parallel.options.env.AWS_SECRET_ACCESS_KEY", "storage_options.key", "storage_options.secret",
        "parallel.options.connect_options.password"]
    params = {"tokens": {"token_list": ["a", "b"]}, "frontend": {"conf": {"hf_token": SECRET}}}
    assert find_secrets(params, CollectStatsConfig) == ["frontend.conf.hf_token"]
    with pytest.raises(ConfigError, match=r"^flow parameters hold a credential \(parallel\.options\.env\.X\)") as err:
        refuse_secrets(["parallel.options.env.X"])
    assert "\n" not in str(err.value)
    refuse_secrets([])  # nothing found: nothing refused


def test_an_env_reference_is_no_credential_and_resolves_where_the_config_is(monkeypatch):
    """``${oc.env:NAME}`` in a deployment's parameters is allowed: the flow-run process resolves it
    from its own environment (and shows the result masked)."""
    monkeypatch.setenv("E3F_TEST_SECRET", SECRET)
    ref = "${oc.env:E3F_TEST_SECRET}"
    overrides = [f"parallel.options.env.AWS_SECRET_ACCESS_KEY={ref}", f"storage_options.secret={ref}"]
    assert secrets_in_overrides(overrides, CollectStatsConfig) == []
    cfg = resolve_config("collect_stats", None, {}, ["manifests.valid=/data/wav.scp", *overrides])
    assert cfg.parallel.options["env"]["AWS_SECRET_ACCESS_KEY"] == cfg.storage_options["secret"] == SECRET
    assert SECRET not in repr(mask_secrets(cfg))
