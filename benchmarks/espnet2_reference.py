"""ESPnet2's own collect-stats on a data directory, as one process of a recipe's stage 10 runs it.

``python benchmarks/espnet2_reference.py WAV_SCP OUT_DIR [--batch-size N] [--threads N]``

ESPnet2's ``collect_stats`` (what ``asr_train.py --collect_stats true`` runs) with ESPnet2's
``DefaultFrontend``, reading ``wav.scp`` with ESPnet2's ``SoundScpReader``; the model is
``ESPnetASRModel.collect_feats`` for audio without text (four lines: ``ESPnetASRModel`` itself
needs ESPnet's whole dependency list, which pip cannot install). ``asr_train.py`` imports far more
than this script, so this is ESPnet2 at its fastest start.
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
    args = parser.parse_args(argv)

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

        def forward(self, **batch):  # noqa: D401 - not used by collect_stats
            raise NotImplementedError

        def collect_feats(self, speech, speech_lengths, **kwargs):
            speech = speech[:, : speech_lengths.max()]
            feats, feats_lengths = self.frontend(speech, speech_lengths)
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

    collect_stats(model=Model().eval(), train_iter=batches(), valid_iter=[next(iter(batches()))],
                  output_dir=Path(args.out_dir), ngpu=0, log_interval=None, write_collected_feats=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
