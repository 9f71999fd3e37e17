"""Decoded recordings kept for the segments of one shard (a Kaldi ``segments`` file cuts many
utterances from one recording: each recording is decoded once per shard), and the shard's next
call's files decoded ahead (:meth:`RecordingCache.following`, :attr:`RecordingCache.ahead`)."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from espnet3_flows.inputs.records import Utterance


class RecordingCache:
    """Decoded recordings of one shard's segments, so each recording is decoded once for all its
    segments in the shard.

    A recording is dropped once all its segments in the shard were read (``uses``), and the
    least recently used ones beyond ``max_bytes`` (a segment read again later then decodes
    its recording again).

    Args:
        uses: Recording key (:func:`recording_key`) → number of the shard's segments in it.
        cwd: Directory commands (``cmd |`` entries) run in; the current one when empty.
        max_bytes: Most bytes of decoded audio kept.
        order: The shard's utterances in the order its calls take them (what :meth:`following`
            looks ahead in); none: nothing is decoded ahead.
    """

    def __init__(self, uses: Mapping[str, int] | None = None, cwd: str = "", max_bytes: int = 2 << 30,
                 order: Sequence[Utterance] = ()):
        self.uses = dict(uses or {})
        self.cwd = cwd
        self.max_bytes = max_bytes
        self.decodes = 0
        self._data: OrderedDict[str, tuple[np.ndarray, int]] = OrderedDict()
        self._headers: dict[str, tuple[int, int]] = {}
        self._bytes = 0
        self._order = list(order)
        self._positions: dict[str, int] | None = None
        #: Decodes started ahead of their call (:func:`~espnet3_flows.inputs.audio.load_many`), by
        #: :func:`ahead_key`, with the settings they decode with; each is taken by the call that
        #: reads its utterance. Those still queued when the cache goes (its shard ended, or
        #: failed) are cancelled.
        self.ahead: dict[tuple[str, str], tuple[Future, Any]] = {}
        self._detached: RecordingCache | None = None
        weakref.finalize(self, _cancel_all, self.ahead)

    def detached(self) -> RecordingCache:
        """A cache with this one's ``cwd`` and nothing else, for whole files decoded on other
        threads (they read only ``cwd``): work queued there then keeps this one, and what it
        holds, from outliving its shard."""
        if self._detached is None:
            self._detached = RecordingCache(cwd=self.cwd, max_bytes=0)
        return self._detached

    def take_ahead(self, utt: Utterance, settings: Any) -> Future | None:
        """The decode of ``utt`` started ahead with the same ``settings`` (taken out), else ``None``."""
        got = self.ahead.pop(ahead_key(utt), None)
        if got is None:
            return None
        if got[1] != settings:
            got[0].cancel()
            return None
        return got[0]

    def start_ahead(self, utt: Utterance, settings: Any, decode: Callable[[Utterance], Future]) -> None:
        """Start decoding ``utt`` ahead of its call (``decode(utt)``), unless it is started already."""
        if ahead_key(utt) not in self.ahead:
            self.ahead[ahead_key(utt)] = (decode(utt), settings)

    def keep_ahead(self, keys: set[tuple[str, str]]) -> None:
        """Cancel and drop the decodes started ahead, but those of ``keys``."""
        for key in [k for k in self.ahead if k not in keys]:
            self.ahead.pop(key)[0].cancel()

    def following(self, utts: Sequence[Utterance]) -> list[Utterance]:
        """The shard's next call's utterances, as its calls go: as many as ``utts`` after the last
        of them in the shard's order (none after the shard's last, or for an utterance not in it)."""
        if not utts or not self._order:
            return []
        if self._positions is None:
            self._positions = {u.utt_id: i for i, u in enumerate(self._order)}
        last = self._positions.get(utts[-1].utt_id)
        return [] if last is None else self._order[last + 1:last + 1 + len(utts)]

    def get(self, key: str, decode: Callable[[], tuple[np.ndarray, int]]) -> tuple[np.ndarray, int]:
        """The recording ``(channels × samples, rate)`` of ``key``, decoded now if not kept."""
        if key in self._data:
            self._data.move_to_end(key)
            return self._data[key]
        samples, rate = decode()
        self.decodes += 1
        self._headers[key] = (samples.shape[-1], rate)
        self._data[key] = (samples, rate)
        self._bytes += samples.nbytes
        while self._bytes > self.max_bytes and len(self._data) > 1:
            _, (old, _) = self._data.popitem(last=False)
            self._bytes -= old.nbytes
        return samples, rate

    def header(self, key: str, read: Callable[[], tuple[int, int]]) -> tuple[int, int]:
        """``(frames, rate)`` of a recording, read once."""
        if key not in self._headers:
            self._headers[key] = read()
        return self._headers[key]

    def done(self, key: str) -> None:
        """One segment of ``key`` was read; the recording is dropped after its last."""
        left = self.uses.get(key, 0) - 1
        self.uses[key] = left
        if left <= 0 and key in self._data:
            self._bytes -= self._data.pop(key)[0].nbytes


def recording_key(utt: Utterance) -> str:
    """The key of an utterance's recording in a :class:`RecordingCache`."""
    return f"{utt.recording}\0{utt.path}"


def ahead_key(utt: Utterance) -> tuple[str, str]:
    """The key of an utterance's decode in :attr:`RecordingCache.ahead`."""
    return utt.utt_id, utt.path


def _cancel_all(ahead: dict[tuple[str, str], tuple[Future, Any]]) -> None:
    for future, _ in ahead.values():
        future.cancel()
    ahead.clear()
