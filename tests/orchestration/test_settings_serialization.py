"""The driver serializes Prefect's settings context once per context object, not once per task."""

from __future__ import annotations

import pytest

import json

from prefect.context import SettingsContext
from prefect.settings import PREFECT_API_KEY, PREFECT_LOGGING_LEVEL, temporary_settings

from espnet3_flows.orchestration.prefect_private.contexts import cache_settings_serialization


@pytest.mark.patch
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


def test_the_patches_target_the_pinned_prefect():
    """Both patches reach into Prefect 3.8's internals (SettingsContext.serialize, the task engine's
    hydrated_context): a Prefect upgrade must re-check them, so this fails loudly when the pin moves."""
    import prefect

    assert prefect.__version__.startswith("3.8."), (
        f"Prefect {prefect.__version__}: re-check espnet3_flows/orchestration/prefect_private/contexts.py "
        "against its SettingsContext.serialize and task_engine.hydrated_context, then update this pin")


@pytest.mark.patch
def test_workers_validate_each_settings_context_once_and_still_see_the_callers_settings():
    import prefect.task_engine as task_engine

    from espnet3_flows.orchestration.prefect_private.contexts import cache_settings_hydration

    assert cache_settings_hydration() and cache_settings_hydration()  # idempotent
    hydrate = task_engine.hydrated_context
    seen = []
    for level in ("DEBUG", "DEBUG", "WARNING"):
        with temporary_settings(updates={PREFECT_LOGGING_LEVEL: level}):
            serialized = json.loads(json.dumps(SettingsContext.get().serialize(), default=str))  # as shipped
        with hydrate({"settings_context": serialized}):
            ctx = SettingsContext.get()
            assert ctx.settings.logging.level == level
            seen.append(ctx)
        assert SettingsContext.get() is not seen[-1]  # the task's context was exited again
    assert seen[0] is not seen[1], "each task enters a context object of its own"
    assert seen[0].settings is seen[1].settings, "the same settings were validated twice"
    assert seen[2].settings is not seen[0].settings
    with hydrate({"tags_context": {"current_tags": ["t"]}}):  # no settings: Prefect's own path
        from prefect.context import TagsContext

        assert "t" in TagsContext.get().current_tags
