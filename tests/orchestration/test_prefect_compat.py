"""The patches of Prefect's internals: verified for the pinned Prefect only, off for any other."""

from __future__ import annotations

import prefect

from espnet3_flows.orchestration import prefect_compat


def test_installed_prefect_is_the_verified_one():
    """Fails on purpose when the Prefect pin changes: read the patches' targets in the new
    version (prefect.client.orchestration's ssl use, SettingsContext.serialize,
    task_engine.hydrated_context), rerun their tests, then add the version to VERIFIED_PREFECT."""
    assert prefect.__version__ in prefect_compat.VERIFIED_PREFECT, (
        f"Prefect {prefect.__version__} is installed; espnet3_flows' patches of Prefect internals were verified "
        f"with {prefect_compat.VERIFIED_PREFECT}: verify them again (orchestration/prefect_compat.py)")


def test_an_unverified_prefect_gets_no_patch(monkeypatch, caplog):
    import importlib

    import prefect.task_engine as task_engine
    from prefect.context import SettingsContext

    monkeypatch.setattr(prefect, "__version__", "99.0.0")
    monkeypatch.setattr(prefect_compat, "_WARNED", [])
    client_module = importlib.import_module("prefect.client.orchestration")
    before = (client_module.ssl, SettingsContext.__dict__["serialize"], task_engine.hydrated_context)
    with caplog.at_level("WARNING"):
        assert not prefect_compat.share_tls_contexts()
        assert not prefect_compat.cache_settings_serialization()
        assert not prefect_compat.cache_settings_hydration()
    assert (client_module.ssl, SettingsContext.__dict__["serialize"], task_engine.hydrated_context) == before
    assert sum("99.0.0" in r.getMessage() for r in caplog.records) == 1  # one warning, not one per call
