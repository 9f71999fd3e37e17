"""extract-features, declared for the job registry (:mod:`espnet3_flows.job_registry`)."""

from typing import Literal

from espnet3_flows.job_registry import FlowParameter, JobSpec, engine_parameters, splits_parameters

JOB = JobSpec(
    name="extract_features",
    title="extract-features",
    description="Extract features per utterance (fbank, an ESPnet2 frontend or a model) into Kaldi ark/scp "
                "and a lhotse CutSet.",
    schema="espnet3_flows.features.job:ExtractFeaturesConfig",
    runners="espnet3_flows.features.job:feature_runners",
    worker_modules=("numpy", "torch", "soundfile", "lhotse", "kaldiio"),
    demo="espnet3_flows.demo:demo_manifest_settings",
    flow_parameters=(
        *splits_parameters("features"),
        FlowParameter("frontend_type", "frontend.type", Literal["fbank", "espnet2", "model"],
                      "`fbank` (log-mel), `espnet2` (an ESPnet2 frontend by `frontend.name`) or `model`."),
        FlowParameter("num_mel_bins", "frontend.num_mel_bins", int, "Mel bins of the fbank."),
        *engine_parameters(),
    ),
)
