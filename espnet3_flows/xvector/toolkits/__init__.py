"""The ``xvector.toolkit`` registry: :data:`TOOLKITS`.

A toolkit is a :class:`XVectorToolkit` registered under its name. Each built-in one is declared in
a module of this package, naming the module of its implementation (imported on a worker only:
these declarations import no torch): ``speechbrain`` (:mod:`.speechbrain`), ``espnet``
(:mod:`.espnet`), ``rawnet`` (:mod:`.rawnet`) and ``custom`` (:mod:`.custom`). Another package adds
one through the entry-point group ``espnet3_flows.xvector_toolkits`` (``name =
"package.module:MyToolkit"``, a subclass or an instance); ``xvector.toolkit: <name>`` then runs it
(``docs/plugins.md``).
"""

from __future__ import annotations

from espnet3_flows.registry import Registry, instance_of
from espnet3_flows.xvector.toolkits.base import XVectorToolkit

__all__ = ["TOOLKITS", "XVectorToolkit"]


def _builtin_toolkits() -> None:
    """The built-in toolkits, in the order the UI's drop-down and the docs list them."""
    from espnet3_flows.xvector.toolkits import custom, espnet, rawnet, speechbrain

    for toolkit in (speechbrain.SpeechbrainToolkit(), espnet.EspnetToolkit(), rawnet.RawnetToolkit(),
                    custom.CustomToolkit()):
        TOOLKITS.register(toolkit.name, toolkit)


#: every ``xvector.toolkit`` by name: the built-in ones, then the installed packages'
TOOLKITS: Registry[XVectorToolkit] = Registry("x-vector toolkit", "xvector.toolkit", builtins=_builtin_toolkits,
                                              accept=instance_of(XVectorToolkit))
