"""Prefect's API clients share one verified TLS context per CA file after share_tls_contexts()."""

from __future__ import annotations

import ssl
from pathlib import Path

import certifi
import prefect.client.orchestration as client_module
import pytest

from espnet3_flows.orchestration.prefect_private.client import _SharedContextSSL, share_tls_contexts

pytestmark = pytest.mark.patch  # every test here checks the shared-TLS-context patch


@pytest.fixture
def shared_ssl(monkeypatch):
    """Install the shared-context ssl on Prefect's client module for one test, then restore it."""
    monkeypatch.setattr(client_module, "ssl", ssl)
    assert share_tls_contexts() is True
    yield client_module.ssl


def _verify_context(client) -> ssl.SSLContext:
    return client._client._transport._pool._ssl_context


def test_clients_share_one_verified_context(shared_ssl, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "https://prefect.example.invalid/api")
    from prefect.client.orchestration import PrefectClient, SyncPrefectClient

    a = SyncPrefectClient("https://prefect.example.invalid/api")
    b = SyncPrefectClient("https://prefect.example.invalid/api")
    c = PrefectClient("https://prefect.example.invalid/api")
    ctx = _verify_context(a)
    assert _verify_context(b) is ctx and _verify_context(c) is ctx
    # verification is what Prefect would have built: certificates and host names checked
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.cert_store_stats()["x509_ca"] > 0


def test_insecure_contexts_are_never_shared(shared_ssl):
    one = shared_ssl.create_default_context()
    two = shared_ssl.create_default_context()
    assert one is not two  # Prefect turns verification off on these; sharing would leak that


def test_changed_ca_file_gets_a_new_context(shared_ssl, tmp_path):
    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(Path(certifi.where()).read_bytes())
    first = shared_ssl.create_default_context(cafile=str(bundle))
    assert shared_ssl.create_default_context(cafile=str(bundle)) is first
    bundle.write_bytes(bundle.read_bytes() + b"\n")
    assert shared_ssl.create_default_context(cafile=str(bundle)) is not first


def test_idempotent_and_leaves_unknown_layouts_alone(monkeypatch):
    monkeypatch.setattr(client_module, "ssl", ssl)
    assert share_tls_contexts() and share_tls_contexts()
    assert isinstance(client_module.ssl, _SharedContextSSL)
    monkeypatch.setattr(client_module, "ssl", object())  # a Prefect that builds contexts elsewhere
    assert share_tls_contexts() is False


def _shares_tls() -> bool:
    import prefect.client.orchestration as module

    return isinstance(module.ssl, _SharedContextSSL)


@pytest.mark.dask
def test_flow_worker_plugin_reaches_workers_that_join_later():
    from distributed import Client, LocalCluster

    from espnet3_flows.orchestration.prefect_worker import PrefectWorkerSetup

    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster, Client(cluster) as client:
        client.register_plugin(PrefectWorkerSetup())
        cluster.scale(2)  # a worker that joins afterwards, like a SLURM job starting late
        client.wait_for_workers(2, timeout=120)
        assert set(client.run(_shares_tls).values()) == {True}
