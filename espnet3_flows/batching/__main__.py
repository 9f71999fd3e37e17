"""``python -m espnet3_flows.batching``: write batch files from shape files."""

from espnet3_flows.batching.cli import run

if __name__ == "__main__":
    run()
