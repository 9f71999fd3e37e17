"""``--dry-run``: check the config, plan every split, read its done records and check the inputs of
the shards a run would compute (:mod:`espnet3_flows.inputs.input_check`); print what a run would
do. It starts no server or cluster and writes nothing, anywhere: a joined data directory or an
unpacked manifest goes to a temporary directory, removed after; a config that names no input has
the demo it would generate only described."""

from __future__ import annotations

import tempfile
from typing import Any

from espnet3_flows.inputs.input_check import InputCheck, check_inputs
from espnet3_flows.orchestration.job_run import PlannedFlow, plan_job
from espnet3_flows.orchestration.jobs import preflight
from espnet3_flows.parallel.cluster import describe_parallel
from espnet3_flows.parallel.scheduler import PlannedRunner
from espnet3_flows.storage import Storage


def dry_run(job: str, cfg: Any) -> int:
    """Print what a run of ``job`` with ``cfg`` would compute and what its inputs hold; the exit
    status: 1 when an input would stop a run (``on_error: fail``), else 0."""
    from espnet3_flows.inputs.demo import pending_demo

    demo = pending_demo(cfg.output_dir, dict(cfg.manifests))
    if demo is not None:
        print(f"{job} (dry run): no input is named, so a run generates the demo data in {demo} and computes it; "
              f"output {cfg.output_dir}. Nothing was written.")
        return 0
    preflight(job, cfg, output=False)
    with tempfile.TemporaryDirectory(prefix="espnet3-flows-dry-run-") as spool:
        run = plan_job(job, cfg, publish=False, spool=Storage(spool))
        _print_plan(job, cfg, run)
        bad = sum(_print_inputs(split, cfg.storage_options) for split in run.runners)
    if bad and cfg.on_error == "fail":
        print(f"error: {bad} input(s) would stop a run (on_error=fail; on_error=skip lists them in skipped.tsv "
              "and goes on)")
        return 1
    return 0


def _print_plan(job: str, cfg: Any, run: PlannedFlow) -> None:
    print(f"{job} (dry run): {run.total_shards} shard(s) in {len(run.runners)} split(s), planned in "
          f"{run.plan_seconds:.1f} s; output {cfg.output_dir}")
    print(f"  cluster: {describe_parallel(cfg.parallel)}")
    if run.pending_shards and cfg.parallel.runs_here(run.pending_shards) and cfg.parallel.backend.owns_cluster:
        print(f"  (none started: {run.pending_shards} shard(s) to compute run in this process, "
              f"parallel.options.inline_shards={cfg.parallel.backend.options_of(cfg.parallel).inline_shards})")


def _print_inputs(split: PlannedRunner, storage_options: Any) -> int:
    """The split's line, then what the check of its pending shards' inputs found; the number of
    bad inputs."""
    pending = split.pending
    runner = split.runner
    print(f"  {runner.split}: {split.plan.num_items} utterances in {len(split.plan.shards)} shard(s): "
          f"{len(split.done)} done, {len(pending)} to compute ({sum(s.num_items for s in pending)} utterances), "
          f"{len(runner.manifest_skipped())} manifest line(s) skipped")
    input_audio = getattr(runner, "input_audio", None)  # (an UtteranceRunner's; a plugin's runner may have none)
    read = input_audio() if input_audio is not None else None
    if read is None or not pending:
        return 0
    key, audio = read
    found = check_inputs(runner.split, pending, audio, storage_options)
    print(f"    inputs: {found.stat_checked} of {found.utterances} audio files stat'ed, "
          f"{sum(found.rates.values())} headers read: {found.problem_count} bad")
    for line in found.problems:
        print(f"      {line}")
    if found.problem_count > len(found.problems):
        print(f"      ... and {found.problem_count - len(found.problems)} more")
    warning = rate_warning(runner.split, found, key, audio.sampling_rate)
    if warning:
        print(f"  warning: {warning}")
    return found.problem_count


def rate_warning(split: str, found: InputCheck, key: str, rate: int) -> str | None:
    """A warning when sampled files are recorded at a rate other than ``rate`` (the job's
    ``key``): naming the rates, and the value to set when most files share another rate."""
    other = {r: n for r, n in found.rates.items() if r != rate}
    if not other:
        return None
    sampled = sum(found.rates.values())
    rates = ", ".join(f"{r} Hz: {n}" for r, n in sorted(found.rates.items()))
    text = (f"split {split}: {sum(other.values())} of {sampled} sampled files are not at {key}={rate} Hz "
            f"({rates}); they are resampled to {rate} Hz")
    common = max(other, key=other.get)
    if 2 * other[common] > sampled:
        text += f". If {common} Hz is your corpus's rate, set {key}={common}"
    return text
