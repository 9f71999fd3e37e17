"""The built-in ``xvector.toolkit`` declarations, one module each, which registers it in
:data:`~espnet3_flows.xvector.config.TOOLKITS`: ``speechbrain`` (:mod:`.speechbrain`), ``espnet``
(:mod:`.espnet`), ``rawnet`` (:mod:`.rawnet`) and ``custom`` (:mod:`.custom`). What a toolkit
declares, and how a plugin adds one, is :mod:`espnet3_flows.xvector.config`'s."""

from __future__ import annotations

from espnet3_flows.xvector.config import TOOLKITS, XVectorToolkit

__all__ = ["TOOLKITS", "XVectorToolkit"]
