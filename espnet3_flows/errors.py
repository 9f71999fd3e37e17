"""The one error type that means "this input item is bad", as opposed to a bug or an outage.

Under ``on_error: skip`` only a :class:`BadItemError` raised by ``forward`` makes an item a
skipped one (listed in ``skipped.tsv``); under ``on_error: fail`` it fails the run at once,
without retries (the item fails the same way every time). Any other exception, a ``ValueError``
from numpy or torch inside a model included, is a failure of the shard: retried, then reported,
never silently turned into skipped items. Raise it (or a subclass) from ``forward`` or from what
``forward`` calls for inputs that cannot be processed: missing or corrupt files, audio too short
for the frontend, features that come out NaN for this input.
"""

from __future__ import annotations


class BadItemError(ValueError):
    """An input item that cannot be processed (the message names why); never a code bug."""
