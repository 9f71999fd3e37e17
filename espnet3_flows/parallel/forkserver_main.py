"""Preloaded by the forkserver (:mod:`.forkserver`): imports the driver's main module there once,
as ``__mp_main__``, so that the workers forked from it do not each run it again.

A child of Python's ``spawn`` and ``forkserver`` start methods re-imports the parent's main
module (a script by its path, ``python -m pkg.mod`` by its name) before it runs anything, unless
its own ``__main__`` is that module already. ``multiprocessing`` means the forkserver's
``'__main__'`` preload to do that once in the server, but on Python 3.11 the server is never
told the path (it asks for ``main_path``; the preparation data names it
``init_main_from_path``), so every forked worker ran the driver's script again: a flow script's
imports (Prefect's flow machinery, this package) were ~0.9 s of each local worker's start, after
its fork, on the 2-core machine of ``benchmarks/`` (``startup``).

:func:`~.forkserver.start_forkserver` names the main module in :data:`~.forkserver.MAIN_VAR`
and preloads this module first; it takes the variable out of the server's environment (forked
workers never see it). A main module that fails to import here is logged and left to the workers, which then import
it themselves (and fail there, as a spawned worker would). One that starts workers or a run when
imported (not under ``if __name__ == "__main__":``) stops at that call, silently: the call recorded
it for the driver, which reports it in one line (:mod:`.main_guard`); the workers stop there too.
The outcome of the import is written to the driver's status file either way.
"""

from __future__ import annotations

import logging
import os
import signal

from espnet3_flows.errors import UnguardedMainError
from espnet3_flows.parallel import main_guard
from espnet3_flows.parallel.forkserver import MAIN_VAR


def _import_driver_main() -> None:
    ref = os.environ.pop(MAIN_VAR, None)
    if not ref:
        return
    from espnet3_flows.parallel.multiprocessing_private import inheriting, main_fixup

    kind, _, target = ref.partition(":")
    fixup = main_fixup(kind)
    main_guard.adopt_status_path()
    if fixup is None:
        main_guard.record(main_guard.FAILED)
        return
    try:
        with inheriting():  # as a spawned child imports it
            fixup(target)
    except UnguardedMainError:
        pass  # recorded where it was raised; the driver says it
    except BaseException:  # the workers import it themselves, as without this
        main_guard.record(main_guard.FAILED)
        logging.getLogger(__name__).warning("the forkserver could not import the main module %s; "
                                            "each worker imports it", target, exc_info=True)
    else:
        main_guard.record(main_guard.IMPORTED)
    # (Prefect's console, which the script's imports may set up, is quieted by the orchestration
    # layer's own preload after this one: espnet3_flows.orchestration.quiet_workers)


_import_driver_main()


def _leave_ctrl_c_to_the_driver() -> None:
    """A Ctrl-C at a terminal reaches every process of its group: the forked workers ignore it (the
    driver ends the run in one line, and they end with it) instead of each printing a
    ``KeyboardInterrupt`` traceback. The forkserver gives its children the handlers its preloads
    set (``multiprocessing.forkserver.main``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


_leave_ctrl_c_to_the_driver()
