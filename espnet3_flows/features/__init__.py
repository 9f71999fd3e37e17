"""extract-features: any frontend's features per utterance, as Kaldi ark/scp and a lhotse CutSet."""
