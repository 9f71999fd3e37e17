"""Shared pytest fixtures and options: real services are started here, once per session."""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

import pytest

#: what ``make`` exports to the commands of its recipes: its flags, and each variable given on its
#: command line (``.ci/run`` runs ``make test VENV=/tmp/...``). A test that runs ``make`` itself
#: would inherit them: ``make distclean`` in a scratch checkout then removed the venv this suite
#: runs from. The suite's processes never see the ``make`` that started them.
MAKE_VARIABLES = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "MAKE_TERMOUT", "MAKE_TERMERR")


def _forget_the_make_that_started_us(environ: MutableMapping[str, str]) -> list[str]:
    """Remove ``make``'s flags and its command-line variables from ``environ``; the names removed.

    GNU make writes ``MAKEFLAGS`` as ``s -- VENV=/tmp/x PYTEST_ARGS=-q\\ -x``: the variables given
    on its command line follow ``--``, a space inside a value escaped with a backslash."""
    flags = " " + environ.get("MAKEFLAGS", "")
    given = flags.split(" -- ", 1)[1] if " -- " in flags else ""
    names = re.findall(r"(?:^|(?<!\\) )([A-Za-z_][A-Za-z0-9_.]*)=", given)
    return [name for name in (*MAKE_VARIABLES, *names) if environ.pop(name, None) is not None]


_forget_the_make_that_started_us(os.environ)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
#: this process's environment before any fixture changed it, for a nested pytest run
_ENVIRONMENT_AT_START = dict(os.environ)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slurm", action="store_true", default=False,
                     help="run tests marked 'slurm' (needs ci/slurm/start.sh)")
    parser.addoption("--run-gpu", action="store_true", default=False,
                     help="run tests marked 'gpu'; each FAILS (never skips) without a CUDA GPU and dask-cuda")


def gpu_missing(dask_cuda: bool = True) -> str | None:
    """Why this machine cannot run the GPU tests, or None when it can (``dask_cuda``: those that
    start a ``local_gpu`` cluster also need dask-cuda)."""
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA GPU visible to torch {torch.__version__} (torch.cuda.is_available() is False)"
    if dask_cuda:
        try:
            import dask_cuda
        except ImportError as exc:
            return f"dask-cuda is not installed ({exc}): make install EXTRAS=dev,gpu CONSTRAINTS=constraints-gpu.txt"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "gpu" in item.keywords and item.config.getoption("--run-gpu"):
        missing = gpu_missing(dask_cuda="dask" in item.keywords)
        if missing:
            pytest.fail(f"--run-gpu was given but {missing}", pytrace=False)
    # speechbrain puts lazy modules (its k2 integration, deprecated redirects) in sys.modules
    # that raise ImportError on any attribute access; hypothesis scans sys.modules and trips.
    import sys

    importutils = sys.modules.get("speechbrain.utils.importutils")
    if importutils is None:
        return
    for name, module in list(sys.modules.items()):
        if isinstance(module, importutils.LazyModule) and module.lazy_module is None:
            del sys.modules[name]


#: the per-test ceiling of a test marked ``slow`` (every other test has pyproject.toml's 120 s; one
#: that needs more than this says so with its own ``timeout`` mark and why)
SLOW_TIMEOUT = 240


def _slow_modules_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The items of modules holding a ``slow`` test first, in collection order otherwise. Under
    ``make test``'s ``-n 3 --dist loadfile --no-loadscope-reorder`` a module runs whole on one
    worker in this order: the minutes-long ones start at once instead of ending the run on one
    worker while the others wait."""
    slow_modules = {item.module for item in items if "slow" in item.keywords}
    return sorted(items, key=lambda item: item.module not in slow_modules)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slurm = pytest.mark.skip(reason="needs SLURM: run ci/slurm/start.sh and pass --run-slurm")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: pass --run-gpu on a GPU machine")
    from espnet3_flows.patches import patches_enabled

    # with every patch off (ESPNET3_FLOWS_PATCHES=off) the suite must stay green; a test of what a
    # patch itself does must then fail on its assertion, which shows the switch took the patch off
    patch_off = pytest.mark.xfail(strict=True, raises=AssertionError,
                                  reason="ESPNET3_FLOWS_PATCHES=off: the patch this test checks is not applied")
    for item in items:
        if "slow" in item.keywords and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT))
        if "patch" in item.keywords and not patches_enabled():
            item.add_marker(patch_off)
        if "slurm" in item.keywords and not config.getoption("--run-slurm"):
            item.add_marker(skip_slurm)
        if "gpu" in item.keywords and not config.getoption("--run-gpu"):
            item.add_marker(skip_gpu)
    items[:] = _slow_modules_first(items)


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A small generated corpus (60 utterances, 3 speakers): split name → manifest path."""
    from espnet3_flows.inputs.demo import make_demo_corpus

    root = tmp_path_factory.mktemp("demo")
    manifests = make_demo_corpus(root, n_utts=60, n_speakers=3, min_seconds=0.5, max_seconds=1.5,
                                 splits={"train": 0.8, "valid": 0.2})
    return {k: str(v) for k, v in manifests.items()}


@pytest.fixture(scope="session")
def moto_server():
    """A real S3 endpoint on loopback (moto's server), shared by the session."""
    from tests.support.servers import MotoServer

    with MotoServer() as server:
        yield server


@pytest.fixture
def s3_output(moto_server, request: pytest.FixtureRequest) -> tuple[str, dict]:
    """A fresh bucket: (``s3://bucket/prefix`` URL, s3fs storage options)."""
    import re
    import uuid

    bucket = re.sub(r"[^a-z0-9-]", "-", f"t-{request.node.name.lower()}")[:40].strip("-") + "-" + uuid.uuid4().hex[:8]
    moto_server.make_bucket(bucket)
    return f"s3://{bucket}/out", moto_server.storage_options()


#: what a run tells its local workers at their start, and must never set in its own process's environment
_RUN_VAR = ("ESPNET3_FLOWS_QUIET", "DASK_LOGGING__DISTRIBUTED")


@pytest.fixture(autouse=True)
def _run_environment_restored():
    """Fails a test that leaves this process's environment changed the way a run does: every
    process the session starts later (an ``env=ssh`` scheduler inherits Dask's logging level
    from it and never says where it listens) would inherit it. Put back either way."""
    before = {name: os.environ.get(name) for name in _RUN_VAR}
    yield
    after = {name: os.environ.get(name) for name in _RUN_VAR}
    if after != before:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        pytest.fail(f"the test left the environment changed: {before} -> {after}")


@pytest.fixture(scope="session")
def suite_environment() -> dict[str, str]:
    """A copy of this process's environment as it was when the suite started (make's variables
    removed, the defaults above set), before a session fixture changed it: for a nested pytest."""
    return dict(_ENVIRONMENT_AT_START)


@pytest.fixture(scope="module")
def dask_client():
    """A real process-based ``distributed.LocalCluster`` with 2 single-threaded workers. Its client is
    not the process's default: a default client would take over every later flow's Dask tasks
    (prefect-dask runs them on it), whatever their ``parallel`` says.

    One per module, with the workers' statistical profiler off: idle, such a cluster took ~12 CPU-s
    a minute on 2 cores (4 each worker, half of it the profiler's 10 ms stack samples, 4 the
    scheduler in this process), and a session-scoped one stayed up for the last ~8 minutes of
    each xdist worker; a start is ~7 CPU-s."""
    import dask
    from distributed import Client, LocalCluster

    with dask.config.set({"distributed.worker.profile.enabled": False}):
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0")
    with cluster, Client(cluster, set_as_default=False) as client:
        yield client


#: the run's one Prefect server, when this process is the xdist controller that started it
_SHARED_SERVER = None


def pytest_configure(config: pytest.Config) -> None:
    """As pytest-xdist's controller: start the Prefect server every worker shares (in a thread:
    the workers start and collect meanwhile) and name its file in the environment they inherit
    (:mod:`tests.support.session_server`)."""
    global _SHARED_SERVER
    from tests.support.session_server import ENV, SharedServer

    workers = config.getoption("numprocesses", None)
    if hasattr(config, "workerinput") or not workers or ENV in os.environ:
        return
    _SHARED_SERVER = SharedServer()
    _SHARED_SERVER.start_in_background()
    os.environ[ENV] = str(_SHARED_SERVER.info_file)


def pytest_unconfigure(config: pytest.Config) -> None:
    global _SHARED_SERVER
    if _SHARED_SERVER is not None:  # every worker has ended: nobody uses it any more
        from tests.support.session_server import ENV

        _SHARED_SERVER.stop()
        _SHARED_SERVER = None
        os.environ.pop(ENV, None)


@pytest.fixture(scope="session")
def prefect_harness():
    """The session's Prefect server, as ``PREFECT_API_URL`` of this process's settings: the run's
    shared one (``make test``: :mod:`tests.support.session_server`), else a Prefect test harness
    (temporary SQLite server) of this process's own. Yields ``{"api_url", "pid"}``.

    Other processes' runs are on a shared server: read your own back by name and output
    directory (:mod:`tests.support.prefect_readback`), never "the latest run"."""
    from tests.support.session_server import ENV, wait_for

    if os.environ.get(ENV):
        from prefect.context import _temporary_global_settings_context, get_settings_context
        from prefect.settings import PREFECT_API_URL, temporary_settings

        info = wait_for(os.environ[ENV])
        # the process-wide settings too, as prefect_test_harness sets them: code in a context
        # copied before this fixture ran (another thread's) reads those
        with temporary_settings(updates={PREFECT_API_URL: info["api_url"]}), \
                _temporary_global_settings_context(get_settings_context()):
            yield info
        return
    yield from _own_harness()


def _own_harness():
    """prefect_test_harness, its server process launched with the shared server's settings."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.testing.utilities import prefect_test_harness

    from tests.support.session_server import server_settings

    # Task-run states recorded in batches (one INSERT a state otherwise: most of this server's CPU
    # in the suite), no block-type registration at start, the unused loop services off (idle, this
    # server took 4.2 CPU-s a minute with them, 3.1 without). Given to the server process alone, in
    # the environment only while it is launched: set any earlier, the harness's settings context
    # would read them and hand them to every private server a test starts in this process
    # (test_local_server saw them).
    launch = SubprocessASGIServer._run_uvicorn_command

    def launch_batched(server: SubprocessASGIServer):
        added = {k: v for k, v in server_settings().items() if k not in os.environ}
        os.environ.update(added)
        try:
            return launch(server)
        finally:
            for key in added:
                del os.environ[key]

    SubprocessASGIServer._run_uvicorn_command = launch_batched
    try:
        with prefect_test_harness(server_startup_timeout=180):
            SubprocessASGIServer._run_uvicorn_command = launch
            from prefect.settings import PREFECT_API_URL

            server = SubprocessASGIServer._instances[None].server_process
            yield {"api_url": str(PREFECT_API_URL.value()), "pid": server.pid}
    finally:
        SubprocessASGIServer._run_uvicorn_command = launch


@pytest.fixture(scope="session")
def session_api_url(prefect_harness) -> str:
    """The session server's ``PREFECT_API_URL``, for a command-line run whose test is not about the
    private server a run with no API configured starts (``cli_env(home, api_url=...)``):
    such a run saves that server's start (~4 CPU-s on 2 cores, the largest fixed cost of a run).
    The tests of the private server itself (``tests/orchestration/test_cli_start.py``,
    ``test_local_server.py``, ``test_early_start.py``, ``test_server_health.py``, the README and
    walkthrough commands) keep it."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    assert url, "the session's Prefect test harness set no PREFECT_API_URL"
    return str(url)
