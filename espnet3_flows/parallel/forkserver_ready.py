"""Preloaded last by the forkserver (:mod:`.forkserver`): records ``forkserver_ready`` in the run's
timeline (:mod:`espnet3_flows.timeline`) when the server's imports are done, the
instant from which local workers fork in milliseconds. Nothing happens unless the timeline is on."""

from espnet3_flows.timeline import mark

mark("forkserver_ready")
