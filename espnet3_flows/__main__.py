"""``python -m espnet3_flows JOB [--config FILE] [--dry-run] [--print-config] [--verbose] [key=value ...]``.

The same command line as ``python flows/<job>.py`` and the ``espnet3-collect-stats`` /
``espnet3-extract-xvectors`` console scripts, for an installed package without a checkout.
"""

from __future__ import annotations

import sys

JOBS = ("collect_stats", "extract_xvectors")


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the job named by the first argument."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in JOBS:
        print(f"usage: python -m espnet3_flows {{{','.join(JOBS)}}} [--help | --config FILE | --dry-run | "
              "--print-config | --verbose | key=value ...]", file=sys.stderr)
        return 0 if args and args[0] in ("-h", "--help") else 2
    from espnet3_flows.orchestration.entry import main as run

    return run(args[0], args[1:])


def collect_stats() -> int:
    """Console script ``espnet3-collect-stats``."""
    from espnet3_flows.orchestration.entry import main as run

    return run("collect_stats")


def extract_xvectors() -> int:
    """Console script ``espnet3-extract-xvectors``."""
    from espnet3_flows.orchestration.entry import main as run

    return run("extract_xvectors")


if __name__ == "__main__":
    sys.exit(main())
