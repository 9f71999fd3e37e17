"""The ``parallel:`` section as a placement reads it: :class:`ParallelSettings`.

:class:`~espnet3_flows.parallel.parallel_config.ParallelConfig` checks a config against the
registered placements (:mod:`espnet3_flows.parallel.backends`), so the placements, the cluster
code and the forkserver type against this protocol of its fields, not against the config's
module. ``tests/parallel/test_backends.py`` keeps the two field lists the same.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar


class ParallelSettings(Protocol):
    """The fields of :class:`~espnet3_flows.parallel.parallel_config.ParallelConfig` (each is
    documented there); a placement returns a changed copy with :func:`dataclasses.replace`."""

    env: str
    n_workers: int
    threads_per_worker: int
    options: dict[str, Any]
    adapt: dict[str, Any]
    allowed_failures: int
    allow_overwrite_lock: bool


#: a :class:`ParallelSettings` of one type, given and returned (a changed copy of a config)
Settings = TypeVar("Settings", bound=ParallelSettings)
