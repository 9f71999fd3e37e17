"""ESPnet2's own collect-stats on a data directory, as one process of a recipe's stage 10 runs it.

``python benchmarks/espnet2_reference.py WAV_SCP OUT_DIR [--batch-size N] [--threads N] [--timing JSON]``

ESPnet2's ``collect_stats`` (what ``asr_train.py --collect_stats true`` runs) with ESPnet2's
``DefaultFrontend``, reading ``wav.scp`` with ESPnet2's ``SoundScpReader``; the model is
``ESPnetASRModel.collect_feats`` for audio without text (four lines: ``ESPnetASRModel`` itself
needs ESPnet's whole dependency list, which pip cannot install). ``asr_train.py`` imports far more
than this script, so this is ESPnet2 at its fastest start. ``--timing`` writes how long the
``collect_stats`` call took (wall and process CPU seconds: reading, the frontend, ESPnet2's sums,
its outputs) and the process CPU seconds inside the frontend, for per-core compute rates.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

FRONTEND_CONF = {"n_fft": 512, "hop_length": 128, "n_mels": 80, "fs": "16k"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wav_scp")
    parser.add_argument("out_dir")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--timing", help="write the compute's seconds to this JSON file")
    args = parser.parse_args(argv)

    import json
    import time

    import numpy as np
    import torch
    from espnet2.asr.frontend.default import DefaultFrontend
    from espnet2.fileio.sound_scp import SoundScpReader
    from espnet2.main_funcs.collect_stats import collect_stats
    from espnet2.train.abs_espnet_model import AbsESPnetModel

    if args.threads:
        torch.set_num_threads(args.threads)

    class Model(AbsESPnetModel):
        def __init__(self) -> None:
            super().__init__()
            self.frontend = DefaultFrontend(**FRONTEND_CONF)

        def forward(self, **batch):  # not used by collect_stats
            raise NotImplementedError

        def collect_feats(self, speech, speech_lengths, **kwargs):
            t0 = time.process_time()
            speech = speech[:, : speech_lengths.max()]
            feats, feats_lengths = self.frontend(speech, speech_lengths)
            timing["frontend_cpu_s"] += time.process_time() - t0
            return {"feats": feats, "feats_lengths": feats_lengths}

    reader = SoundScpReader(args.wav_scp, always_2d=False)

    def batches():
        keys = list(reader.keys())
        for i in range(0, len(keys), args.batch_size):
            group = keys[i:i + args.batch_size]
            waves = [np.asarray(reader[k][1], dtype=np.float32) for k in group]
            lengths = torch.tensor([len(w) for w in waves])
            speech = torch.zeros(len(waves), int(lengths.max()))
            for j, w in enumerate(waves):
                speech[j, : len(w)] = torch.from_numpy(w)
            yield group, {"speech": speech, "speech_lengths": lengths}

    timing = {"frontend_cpu_s": 0.0}
    model, valid = Model().eval(), [next(iter(batches()))]
    wall, cpu = time.perf_counter(), time.process_time()
    collect_stats(model=model, train_iter=batches(), valid_iter=valid, output_dir=Path(args.out_dir), ngpu=0,
                  log_interval=None, write_collected_feats=False)
    timing.update(collect_wall_s=time.perf_counter() - wall, collect_cpu_s=time.process_time() - cpu,
                  utterances=len(reader), threads=torch.get_num_threads())
    if args.timing:
        Path(args.timing).write_text(json.dumps(timing) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
