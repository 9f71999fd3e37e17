"""extract-features, declared for the job registry (:mod:`espnet3_flows.job_registry`)."""

from espnet3_flows.job_registry import JobSpec

JOB = JobSpec(
    name="extract_features",
    title="extract-features",
    description="Extract features per utterance (fbank, an ESPnet2 frontend or a model) into Kaldi ark/scp "
                "and a lhotse CutSet.",
    schema="espnet3_flows.features.config:ExtractFeaturesConfig",
    runners="espnet3_flows.features.job:feature_runners",
    worker_modules=("numpy", "torch", "soundfile", "lhotse", "kaldiio"),
    demo="espnet3_flows.job_config:demo_manifest_settings",
)
