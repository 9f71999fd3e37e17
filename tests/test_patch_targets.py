"""What this package patches in other libraries is still there in the installed versions (an
upgrade that removed or renamed a target fails here, not silently in a run), and the one switch,
``ESPNET3_FLOWS_PATCHES=off``, leaves every one of them alone outside Prefect (whose patches
``tests/orchestration/test_prefect_private.py`` checks the same way)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from espnet3_flows import patches


def test_every_patched_target_exists():
    import atexit
    import multiprocessing.spawn
    import threading

    import distributed.utils
    from distributed import SpecCluster
    from distributed.deploy.cluster import Cluster

    # keep_restarted_workers: SpecCluster's own timer-driven status update, over the base class's
    assert "_update_worker_status" in vars(SpecCluster) and "_update_worker_status" in vars(Cluster)
    # keep_dask_preload: Dask's "forkserver preload chosen" flag
    assert isinstance(getattr(distributed.utils, "_forkserver_preload_set", None), bool)
    # forkserver_main: how a forked child's main module is re-imported
    assert callable(multiprocessing.spawn._fixup_main_from_path)
    assert callable(multiprocessing.spawn._fixup_main_from_name)
    # exit_now: the interpreter's first steps at exit
    assert callable(threading._shutdown) and callable(atexit._run_exitfuncs)


def test_the_multiprocessing_names_read_are_those_cpython_uses():
    """``multiprocessing_private``'s names, in this Python's own code: ``spawn`` and ``forkserver``
    set ``_inheriting`` around the main module's import and read it for their bootstrapping check;
    the forkserver keeps its process id and stop where they are read; a forked worker's import of
    the main module goes through ``spawn``'s two fixups."""
    import inspect
    import multiprocessing.forkserver
    import multiprocessing.spawn

    from espnet3_flows.parallel import multiprocessing_private as private

    assert "process.current_process()._inheriting = True" in inspect.getsource(multiprocessing.spawn._main)
    assert "getattr(process.current_process(), '_inheriting', False)" in inspect.getsource(
        multiprocessing.spawn._check_not_importing_main)
    server = multiprocessing.forkserver._forkserver
    assert hasattr(server, "_forkserver_pid") and callable(server._stop)
    assert private.main_fixup("path") is multiprocessing.spawn._fixup_main_from_path
    assert private.main_fixup("name") is multiprocessing.spawn._fixup_main_from_name
    with private.inheriting():
        assert private.importing_main()
    assert not private.importing_main()


def test_the_dataset_fingerprint_read_is_what_datasets_keys_its_cache_on():
    """``dataset_fingerprint`` reads ``Dataset._fingerprint``: in the installed ``datasets``
    (a verified major version) a non-empty string, kept by ``save_to_disk``/``load_from_disk``
    and new after a transform, as ``datasets``' own cache needs it to be."""
    datasets = pytest.importorskip("datasets")
    from espnet3_flows.inputs.formats.hf_fingerprint import VERIFIED_MAJORS

    assert int(datasets.__version__.split(".")[0]) in VERIFIED_MAJORS
    ds = datasets.Dataset.from_dict({"id": ["a", "b"]})
    assert isinstance(ds._fingerprint, str) and ds._fingerprint
    assert ds.map(lambda row: {"id": row["id"] + "x"})._fingerprint != ds._fingerprint


def test_the_fbank_layout_read_is_lhotses():
    """``lhotse_private.fbank_layout`` reads, in the installed lhotse (a verified release): its framing
    function, and the window, mel matrix and floor of ``Wav2LogFilterBank`` with the shapes the
    fast path multiplies by."""
    import lhotse
    from lhotse.features.kaldi.layers import Wav2LogFilterBank

    from espnet3_flows.frontends.lhotse_private import fbank_layout, lhotse_verified

    assert lhotse_verified(), lhotse.__version__
    layout = fbank_layout(lhotse.Fbank(lhotse.FbankConfig(num_mel_bins=40)))
    assert isinstance(lhotse.Fbank().extractor, Wav2LogFilterBank)
    assert layout.window.shape == (layout.length,) and layout.mel.shape == (layout.pad_length // 2 + 1, 40)
    assert layout.frame(__import__("torch").zeros(1, 16000), layout.length, layout.shift, True).shape[-1] == layout.length


@pytest.fixture
def switched_off(monkeypatch):
    monkeypatch.setenv(patches.VAR, "off")
    assert not patches.patches_enabled()


@pytest.mark.parametrize("value, enabled", [("", True), ("on", True), ("off", False), ("OFF", False), ("0", False),
                                            ("false", False), ("no", False)])
def test_the_switch_reads_its_variable(monkeypatch, value, enabled):
    monkeypatch.setenv(patches.VAR, value)
    assert patches.patches_enabled() is enabled


def test_off_leaves_dask_alone(switched_off, monkeypatch):
    import distributed.utils
    from distributed import SpecCluster

    from espnet3_flows.parallel.dask_private import keep_dask_preload, keep_restarted_workers
    from espnet3_flows.parallel.parallel_config import ParallelConfig

    cluster = SpecCluster.__new__(SpecCluster)  # (no scheduler: only its attributes are looked at)
    keep_restarted_workers(cluster)
    assert "_update_worker_status" not in vars(cluster)
    monkeypatch.setattr(distributed.utils, "_forkserver_preload_set", False)
    keep_dask_preload()
    assert distributed.utils._forkserver_preload_set is False
    local = ParallelConfig(env="local", n_workers=2)
    assert not local.backend.forks_workers(local)  # spawned workers instead

    monkeypatch.setenv(patches.VAR, "on")
    keep_restarted_workers(cluster)
    assert "_update_worker_status" in vars(cluster)
    keep_dask_preload()
    assert distributed.utils._forkserver_preload_set is True
    assert local.backend.forks_workers(local)


@pytest.mark.parametrize("switch", ["on", "off"])
def test_exit_now_runs_the_exit_handlers_either_way(switch):
    code = ("import atexit, sys\n"
            "from espnet3_flows.orchestration.entry import exit_now\n"
            "atexit.register(lambda: print('handlers ran', flush=True))\n"
            "print('before', flush=True)\n"
            "exit_now(3)\n"
            "print('not reached')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, patches.VAR: switch})
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["before", "handlers ran"]


def test_every_named_patch_is_a_function_that_asks_for_its_name():
    """``-name`` turns off one patch: every name of ``PATCHES`` is a function of the module it
    names, and that module asks the switch for that name (a renamed patch fails here)."""
    import importlib
    import inspect

    for name, where in patches.PATCHES.items():
        module, _, qualname = where.partition(":")
        target = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
        assert callable(target) and qualname.endswith(name), (name, where)
        assert f'"{name}"' in inspect.getsource(target), f"{where} never asks for {name!r}"


@pytest.mark.parametrize("value, off", [("-share_tls_contexts", {"share_tls_contexts"}),
                                         ("on,-exit_now, -forks_workers", {"exit_now", "forks_workers"})])
def test_minus_a_name_turns_that_patch_off_alone(monkeypatch, value, off):
    monkeypatch.setenv(patches.VAR, value)
    assert patches.patches_enabled()  # the others stay
    assert {name for name in patches.PATCHES if not patches.patches_enabled(name)} == off


@pytest.mark.parametrize("value", ["-share_tls_context", "share_tls_contexts", "-"])
def test_a_switch_that_names_no_patch_is_an_error(monkeypatch, value):
    monkeypatch.setenv(patches.VAR, value)
    with pytest.raises(ValueError, match="the patches: share_tls_contexts"):
        patches.patches_enabled("exit_now")


def test_one_prefect_patch_off_leaves_the_others_installed():
    """In a fresh process: ``-prompt_heartbeat_stop`` leaves Prefect's heartbeats as they are and
    installs the TLS and fork-exit patches all the same."""
    code = ("import os\n"
            "os.environ['ESPNET3_FLOWS_PATCHES'] = '-prompt_heartbeat_stop'\n"
            "import prefect.flow_engine as flow_engine\n"
            "from espnet3_flows.orchestration.prefect_private import client, lifecycle\n"
            "before = flow_engine._send_heartbeats\n"
            "print(lifecycle.prompt_heartbeat_stop(), flow_engine._send_heartbeats is before,"
            " client.share_tls_contexts(), lifecycle.forked_children_exit_cleanly())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True", "True", "True"]
