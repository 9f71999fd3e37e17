"""The ``frontend.type`` registry: what a kind of frontend declares, and :data:`FRONTENDS`.

A kind of frontend is a :class:`FrontendType` registered under its name. The built-in ones are
one module each, which registers it (:mod:`.fbank_type`, :mod:`.model_type`, :mod:`.espnet2_type`,
:mod:`.none_type`); another package
adds one through the entry-point group ``espnet3_flows.frontends`` (``name =
"package.module:MyFrontendType"``, a subclass or an instance), and ``frontend.type: <name>`` then
runs it with ``frontend.conf`` as its options. ``docs/plugins.md`` shows one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar
from collections.abc import Mapping

from espnet3_flows.registry import Registry, instance_of

if TYPE_CHECKING:
    from espnet3_flows.frontends.frontend import FrontendConfig
    from espnet3_flows.frontends.wave_frontends import Frontend


class FrontendType:
    """One ``frontend.type``: how its options are checked, what of them the shard hashes cover,
    which modules its workers import, and how a worker builds it.

    Subclass, set ``name`` and ``version`` and override :meth:`build` (and what else differs).
    The frontend :meth:`build` returns is called with a call's waveforms (float32, mono, at
    ``frontend.sampling_rate``) and the model keyword arguments, and returns one ``(frames, dim)``
    float32 array per waveform (:class:`~espnet3_flows.frontends.wave_frontends.Frontend`).
    """

    #: the ``frontend.type`` it is registered as
    name: ClassVar[str] = ""
    #: hashed into every shard it computes: change it when its features change
    version: ClassVar[str] = ""
    #: whether ``frontend.conf`` holds its options (a plugin's options go there)
    takes_conf: ClassVar[bool] = True
    #: whether it runs on ``frontend.device`` (else only ``cpu`` is accepted)
    takes_device: ClassVar[bool] = False
    #: whether it runs in ``frontend.precision`` (else only ``float32`` is accepted)
    takes_precision: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"<frontend type {self.name!r}>"

    def check(self, cfg: FrontendConfig) -> None:
        """Check (and complete) ``cfg``'s options of this type on the driver; raise
        :class:`~espnet3_flows.config.ConfigError`."""

    def hashed(self, cfg: FrontendConfig, base: Mapping[str, Any]) -> dict[str, Any]:
        """What decides the features, for the shard hashes: ``base`` (type, sampling rate,
        channel, longest recording) and this type's options and version."""
        from espnet3_flows.config import to_plain

        return {**base, "conf": to_plain(cfg.conf), "implementation": f"{self.name}/{self.version}"}

    def modules(self, cfg: FrontendConfig) -> tuple[str, ...]:
        """Modules a worker imports to build it (forked local workers import them once)."""
        return (type(self).__module__,)

    def build(self, cfg: FrontendConfig) -> Frontend | None:
        """The frontend a worker builds once (``None``: lengths only, no features)."""
        raise NotImplementedError


#: every ``frontend.type`` by name: the built-in ones, then the installed packages'
FRONTENDS: Registry[FrontendType] = Registry(
    "frontend", "frontend.type", accept=instance_of(FrontendType),
    builtins=tuple(f"espnet3_flows.frontends.{m}" for m in ("none_type", "fbank_type", "model_type", "espnet2_type")))
