"""extract-xvectors, declared for the job registry (:mod:`espnet3_flows.job_registry`)."""

from espnet3_flows.job_registry import JobSpec

JOB = JobSpec(
    name="extract_xvectors",
    title="extract-xvectors",
    description="Extract a speaker embedding per utterance (speechbrain, ESPnet-SPK, RawNet3), with ESPnet2 ark/scp and "
                "speaker means.",
    schema="espnet3_flows.xvector.job_config:XVectorJobConfig",
    runners="espnet3_flows.xvector.job:xvector_runners",
    worker_modules=("numpy", "torch", "soundfile"),
    preflight="espnet3_flows.xvector.job:preflight",
    demo="espnet3_flows.xvector.job_config:demo_settings",
)
