"""The driver serializes Prefect's settings context once per context object, not once per task."""

from __future__ import annotations

import json

from prefect.context import SettingsContext
from prefect.settings import PREFECT_API_KEY, PREFECT_LOGGING_LEVEL, temporary_settings

from espnet3_flows.orchestration.settings_serialization import cache_settings_serialization


def test_same_result_as_prefect_and_every_caller_gets_its_own_copy():
    assert cache_settings_serialization() and cache_settings_serialization()  # idempotent
    original = SettingsContext.serialize.__wrapped__
    ctx = SettingsContext.get()
    first = ctx.serialize()
    assert first == original(ctx)
    first["settings"]["logging"] = "changed by a caller"
    again = ctx.serialize()
    assert again == original(ctx) and again is not first


def test_new_settings_are_serialized_afresh_and_secrets_stay_hidden():
    cache_settings_serialization()
    before = SettingsContext.get().serialize()
    with temporary_settings(updates={PREFECT_LOGGING_LEVEL: "DEBUG", PREFECT_API_KEY: "pnu_secret_for_test"}):
        ctx = SettingsContext.get()
        inside = ctx.serialize(include_secrets=True)
        assert inside["settings"]["logging"]["level"] == "DEBUG"
        assert "pnu_secret_for_test" in json.dumps(inside, default=str)
        hidden = ctx.serialize(include_secrets=False)  # right after the same context with secrets
        assert "pnu_secret_for_test" not in json.dumps(hidden, default=str)
    assert SettingsContext.get().serialize() == before
