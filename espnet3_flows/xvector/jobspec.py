"""extract-xvectors, declared for the job registry (:mod:`espnet3_flows.job_registry`)."""

from espnet3_flows.job_registry import FlowParameter, JobSpec, engine_parameters, splits_parameters

JOB = JobSpec(
    name="extract_xvectors",
    title="extract-xvectors",
    description="Extract a speaker embedding per utterance (speechbrain), with ESPnet2 ark/scp and speaker means.",
    schema="espnet3_flows.xvector.job:XVectorJobConfig",
    runners="espnet3_flows.xvector.job:xvector_runners",
    worker_modules=("numpy", "torch", "soundfile"),
    preflight="espnet3_flows.xvector.job:preflight",
    demo="espnet3_flows.xvector.job:demo_settings",
    flow_parameters=(
        FlowParameter("pretrained_model", "xvector.pretrained_model", str | None,
                      "A local speechbrain model directory (`hyperparams.yaml` + checkpoints) or a hub id "
                      "already in the local cache."),
        *splits_parameters("xvectors"),
        FlowParameter("spk_embed_tag", "xvector.spk_embed_tag", str,
                      "Sub-directory and file names of the embeddings (`{output_dir}/{tag}/{split}/{tag}.scp`)."),
        FlowParameter("device", "xvector.device", str, "`cpu`, `cuda` or `cuda:N`."),
        FlowParameter("batch_size", "xvector.batch_size", int,
                      "Utterances per model call, length-sorted within a shard (0: 1 on CPU, 16 on CUDA)."),
        *engine_parameters(),
    ),
)
