"""Command line and one-call Python entry: shape files in, ``batches/<split>.txt`` + report out."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, Union

from espnet3_flows.batching.config import BatchConfig
from espnet3_flows.batching.lengths import ColumnSource, LengthTable, read_path_list
from espnet3_flows.batching.plan import build_batch_plan
from espnet3_flows.batching.report import BatchReport, summarize_plan
from espnet3_flows.storage import replace_atomically

PathLike = Union[str, "os.PathLike[str]"]
_SPLIT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def export_batches(
    table: LengthTable,
    config: BatchConfig,
    output_dir: PathLike,
    split: str,
) -> BatchReport:
    """Plan batches for ``table`` and write ``output_dir/batches/<split>.txt`` and ``.json``.

    The text file has one batch a line, utterance ids separated by spaces, in plan
    order. The JSON file holds the report (with the settings that produced it) and
    the names of the shape files.

    Args:
        table: Lengths to batch (see :class:`LengthTable` constructors).
        config: Strategy and budget.
        output_dir: Root folder; ``batches/`` is created inside it.
        split: Name of the data split (``train``, ``valid``...); letters, digits, ``_.-``.

    Returns:
        The plan's :class:`BatchReport`.

    Raises:
        ValueError: A split name that is not a plain file name.
    """
    if not _SPLIT_NAME.match(split):
        raise ValueError(f"split name {split!r} must be letters, digits, '_', '.' or '-'")
    plan = build_batch_plan(table, config)
    report = summarize_plan(plan, table)
    folder = Path(output_dir) / "batches"
    plan.write_text(folder / f"{split}.txt")
    record = {"report": report.to_dict(), "sources": table.column_names}
    text = json.dumps(record, indent=2) + "\n"
    replace_atomically(folder / f"{split}.json", lambda f: f.write(text.encode("utf-8")))
    return report


class _AppendColumn(argparse.Action):
    """Keeps ``--shape-file`` and ``--shape-list`` in one ordered list of columns."""

    def __call__(self, parser: Any, namespace: Any, value: Any, option: Any = None) -> None:
        columns = list(getattr(namespace, self.dest) or [])
        columns.append(read_path_list(value) if option == "--shape-list" else value)
        setattr(namespace, self.dest, columns)


def _word_parser(choices: dict[str, Any]) -> Any:
    """An argparse ``type`` taking one of the words in ``choices`` (any case) to its value."""
    names = list(choices)
    expected = f"expected {', '.join(names[:-1])} or {names[-1]}"

    def parse(text: str) -> Any:
        if text.lower() not in choices:
            raise argparse.ArgumentTypeError(expected)
        return choices[text.lower()]

    return parse


_parse_bool = _word_parser({"true": True, "false": False})
_parse_descending = _word_parser({"true": True, "false": False, "none": None})


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m espnet3_flows.batching``."""
    parser = argparse.ArgumentParser(
        prog="python -m espnet3_flows.batching",
        description="Write length-sorted / budgeted training batches from ESPnet2 shape files.",
    )
    inputs = parser.add_argument_group("inputs")
    inputs.add_argument(
        "--shape-file", dest="columns", action=_AppendColumn, metavar="FILE",
        help="a shape file (uttid 123,80); repeat for files sharing ids, the first drives sorting",
    )
    inputs.add_argument(
        "--shape-list", dest="columns", action=_AppendColumn, metavar="LIST",
        help="a file listing shape files with disjoint ids, concatenated into one column",
    )
    inputs.add_argument("--group-file", help="uttid group file (utt2spk, utt2category...)")
    inputs.add_argument(
        "--frame-shift", type=float, help="seconds per length unit of the first shape file"
    )
    strategy = parser.add_argument_group(
        "strategy", "ESPnet2's spellings work too: --batch_type, --batch_bins, --batch_size, --sort_in_batch, "
                    "--sort_batch")
    strategy.add_argument("--batch-type", "--batch_type", choices=["sorted", "numel", "length"], default="numel")
    strategy.add_argument("--batch-size", "--batch_size", type=int, help="rows per batch (sorted)")
    strategy.add_argument(
        "--batch-bins", "--batch_bins", type=int,
        help="numel: padded elements n*sum(max_len*dim); length: padded lengths n*sum(max_len) over "
             "every shape file (ESPnet2)")
    strategy.add_argument("--max-frames", type=float, help="length: n * longest first-column length")
    strategy.add_argument(
        "--max-duration", type=float, help="length: n * longest duration in seconds (lhotse's max_duration)")
    strategy.add_argument(
        "--padding", type=_parse_bool, default=True, metavar="{true,false}",
        help="length: count rows at the batch's longest length (true, default) or their own (false)")
    strategy.add_argument(
        "--is-descending", type=_parse_descending, default=True, metavar="{true,false,none}",
        help="sort longest first, shortest first, or keep file order (default: true)",
    )
    strategy.add_argument("--sort-in-batch", "--sort_in_batch", choices=["descending", "ascending"],
                          help="ids within a batch longest or shortest first (default: fill order)")
    strategy.add_argument("--sort-batch", "--sort_batch", choices=["descending", "ascending"],
                          help="batches long to short or short to long (default: fill order)")
    strategy.add_argument("--ngpu", type=int, default=1, help="devices each batch is split over")
    strategy.add_argument(
        "--uneven", choices=["borrow", "drop"], default="borrow",
        help="rows that do not split evenly over ngpu: repeat neighbours or leave out",
    )
    strategy.add_argument("--group-by", action="store_true", help="never mix groups in a batch")
    strategy.add_argument(
        "--strict", action="store_true", help="an over-budget utterance is an error"
    )
    output = parser.add_argument_group("output")
    output.add_argument("--output-dir", required=True, help="writes DIR/batches/<split>.txt")
    output.add_argument("--split", required=True, help="split name: train, valid...")
    output.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> BatchReport:
    """Run the command line; prints the report and returns it.

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).

    Raises:
        ValueError: Bad input files or settings (the message names file, line and id).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.columns:
        parser.error("give at least one --shape-file or --shape-list")
    config = BatchConfig(**{f.name: getattr(args, f.name) for f in fields(BatchConfig)})  # one option per setting
    columns: list[ColumnSource] = args.columns
    table = LengthTable.from_shape_files(
        columns, frame_shift=args.frame_shift, group_file=args.group_file
    )
    report = export_batches(table, config, args.output_dir, args.split)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return report


def run() -> None:
    """Console entry: errors become one line on stderr and exit status 1."""
    try:
        main()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
