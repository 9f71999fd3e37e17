"""What a user writes beside a script: a runner module (``my_runners.py``) with a provider of
numbers and a runner that doubles them, written only against ESPnet3's API. Tests that run a
user's script in its own process write it beside the script."""

#: ``my_runners.py``: ``Numbers({"n": n})`` and ``Double``, whose ``forward`` returns ``2 * item``
USER_RUNNERS = '''
from espnet3_flows.parallel import BaseRunner, EnvironmentProvider


class Numbers(EnvironmentProvider):
    def build_env_local(self):
        return {"dataset": list(range(self.config["n"]))}

    def build_worker_setup_fn(self):
        n = self.config["n"]
        return lambda: {"dataset": list(range(n))}


class Double(BaseRunner):
    @staticmethod
    def forward(idx, dataset, **env):
        return 2 * dataset[idx]
'''
