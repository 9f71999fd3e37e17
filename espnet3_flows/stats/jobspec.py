"""collect-stats, declared for the job registry (:mod:`espnet3_flows.job_registry`)."""

from typing import Literal

from espnet3_flows.job_registry import FlowParameter, JobSpec, engine_parameters, splits_parameters

JOB = JobSpec(
    name="collect_stats",
    title="collect-stats",
    description="Collect feature shapes and exact global mean/variance (ESPnet2 feats_stats.npz) per split.",
    schema="espnet3_flows.stats.job:CollectStatsConfig",
    runners="espnet3_flows.stats.job:collect_stats_runners",
    worker_modules=("numpy", "torch", "soundfile", "lhotse", "matplotlib.figure", "matplotlib.backends.backend_agg"),
    demo="espnet3_flows.demo:demo_manifest_settings",
    flow_parameters=(
        *splits_parameters("stats"),
        FlowParameter("batch_size", "batch_size", int, "Utterances per forward call."),
        FlowParameter("frontend_type", "frontend.type", Literal["fbank", "none"],
                      "`fbank` (80-dim log-mel) or `none` (lengths only)."),
        FlowParameter("sampling_rate", "frontend.sampling_rate", int, "Audio is resampled to this rate."),
        FlowParameter("num_mel_bins", "frontend.num_mel_bins", int, "Mel bins of the fbank."),
        FlowParameter("write_collected_feats", "write_collected_feats", bool, "Also write the features as Kaldi ark/scp."),
        *engine_parameters(),
    ),
)
