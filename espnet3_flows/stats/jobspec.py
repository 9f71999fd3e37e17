"""collect-stats, declared for the job registry (:mod:`espnet3_flows.job_registry`)."""

from espnet3_flows.job_registry import JobSpec

JOB = JobSpec(
    name="collect_stats",
    title="collect-stats",
    description="Collect feature shapes and exact global mean/variance (ESPnet2 feats_stats.npz) per split.",
    schema="espnet3_flows.stats.config:CollectStatsConfig",
    runners="espnet3_flows.stats.job:collect_stats_runners",
    # lhotse comes with the fbank frontend (frontend_modules); matplotlib is imported by the merge, beside its
    # reading of the shards (0.5 s of every forkserver's start otherwise, before any shard could run)
    worker_modules=("numpy", "torch", "soundfile"),
    demo="espnet3_flows.job_config:demo_manifest_settings",
)
