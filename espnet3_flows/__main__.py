"""``python -m espnet3_flows JOB [--config FILE] [--dry-run] [--print-config] [--verbose] [key=value ...]``.

The same command line as ``python flows/<job>.py`` and the ``espnet3-<job>`` console scripts
(``espnet3-collect-stats``, ...), for an installed package without a checkout. The jobs are
those of :mod:`espnet3_flows.job_registry`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the job named by the first argument."""
    from espnet3_flows.job_registry import available_jobs
    from espnet3_flows.orchestration.early_start import start_early
    from espnet3_flows.orchestration.interrupt import exit_on_ctrl_c

    args = list(sys.argv[1:] if argv is None else argv)
    jobs = available_jobs()
    early = None
    if args and args[0] in jobs:
        if argv is None:  # this process's own command line: Ctrl-C ends it in one line, status 130
            exit_on_ctrl_c(args[0], args[1:])
        early = start_early(args[0], args[1:])  # the server, the plan and the workers start while the job's imports run
    if not args or args[0] not in jobs:
        listing = "\n".join(f"  {name:18s} {spec.description}" for name, spec in jobs.items())
        usage = (f"usage: {_program(argv)} {{{','.join(jobs)}}} [--help | --config FILE | --dry-run | "
                 f"--print-config | --verbose | key=value ...]\n\njobs:\n{listing}")
        if not args or args[0] in ("-h", "--help"):  # asked for the list: stdout, success
            print(usage)
            return 0
        from espnet3_flows.config import did_you_mean

        hint = did_you_mean(args[0].replace("-", "_"), jobs)
        print(f"{usage}\n\nerror: unknown job {args[0]!r}{hint}", file=sys.stderr)
        return 2
    from espnet3_flows.orchestration.entry import main as run

    return run(args[0], args[1:], early=early)


def _program(argv: list[str] | None) -> str:
    """The command as the user typed it: ``espnet3-flows`` from the console script, else (``-m``,
    or :func:`main` called with its own ``argv``) ``python -m espnet3_flows``."""
    name = os.path.basename(sys.argv[0]) if argv is None and sys.argv and sys.argv[0] else ""
    return name if name and not name.endswith(".py") and not name.startswith("-") else "python -m espnet3_flows"


def __getattr__(name: str) -> Callable[[], int]:
    """``espnet3_flows.__main__:<job>``: the console-script entry of a registered job."""
    from espnet3_flows.job_registry import available_jobs

    if name not in available_jobs():
        raise AttributeError(name)

    def script() -> int:
        from espnet3_flows.orchestration.early_start import start_early

        early = start_early(name, sys.argv[1:])  # server, plan and workers start while the job's imports run
        from espnet3_flows.orchestration.entry import exit_now
        from espnet3_flows.orchestration.entry import main as run

        exit_now(run(name, early=early))

    return script


def cli() -> int:
    """``espnet3-flows JOB ...`` and ``python -m espnet3_flows JOB ...``: :func:`main`, then the
    process ends at once (:func:`~espnet3_flows.orchestration.entry.exit_now`)."""
    status = main()
    if "espnet3_flows.orchestration.entry" not in sys.modules:  # usage printed: nothing heavy to skip
        return status
    from espnet3_flows.orchestration.entry import exit_now

    exit_now(status)


if __name__ == "__main__":
    sys.exit(cli())
