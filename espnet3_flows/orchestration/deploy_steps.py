"""Prefect deployment steps of this project (``pull:`` in ``deployments/prefect.yaml``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

#: The worker's environment variable naming the flow runs' working directory
WORKDIR_ENV = "ESPNET3_FLOWS_WORKDIR"


def working_directory(directory: str | None = None) -> dict[str, str]:
    """Pull step: the flow run's working directory, where relative paths in its parameters
    (``manifests``, ``output_dir``, ``config_file``) resolve.

    ``directory`` if given, else ``$ESPNET3_FLOWS_WORKDIR`` on the worker, else the directory the
    worker was started in; created if missing. Prefect changes into the returned ``directory``
    before it imports the flow, so a deployment does not depend on where ``prefect deploy`` ran.
    """
    chosen = directory or os.environ.get(WORKDIR_ENV) or os.getcwd()
    path = Path(chosen).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    log.info("espnet3-flows: the flow run's working directory is %s", path)
    return {"directory": str(path)}
