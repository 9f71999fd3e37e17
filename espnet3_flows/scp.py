"""Kaldi scp files published from a staging directory: their lines pointed at where the arks went.

kaldiio writes an ark's path into its scp verbatim (``utt /tmp/staging/x.ark:42``), and a reader
opens it as written. A shard or a merge writes both under a local staging directory that is gone
once they are published, so every scp is rewritten, before it is published, to name each ark
by its published URI; an scp line still pointing into the staging directory at something not
published is an error, never a published file that points nowhere.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

#: ``path:offset`` with an optional Kaldi range ``[...]``: the value of an scp line naming an ark
_ARK_REF = re.compile(r"^(?P<path>.+):(?P<offset>\d+)(?P<range>\[[^\]]*\])?$")


def point_scps_at_published(staged: Sequence[tuple[Path, str]], uri: Callable[[str], str], staging: Path) -> int:
    """Rewrite, in place, each staged ``*.scp`` so that lines naming a staged file name its
    published URI instead: ``key path:offset[range]`` (a Kaldi ark; keys, offsets and ranges
    kept) and ``key path`` (a whole file, as ESPnet2's ``NpyScpWriter`` writes ``.npy`` files).

    Args:
        staged: ``(local path, published name)`` of every file about to be published.
        uri: The published URI of a published name.
        staging: The staging directory the files are under.

    Returns:
        The number of lines rewritten.

    Raises:
        RuntimeError: an scp line points inside ``staging`` at a file that is not published.
    """
    scps = [path for path, _ in staged if path.suffix == ".scp"]
    if not scps:  # most shards (one .pt per utterance publishes many files): no path resolved
        return 0
    targets: dict[str, str] = {}
    for path, rel in staged:
        targets[str(path)] = targets[os.path.realpath(path)] = uri(rel)
    roots = {str(staging), os.path.realpath(staging)}
    rewritten = 0
    for path in scps:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # not a Kaldi scp
        lines, changed = [], False
        for lineno, line in enumerate(text.splitlines(keepends=True), start=1):
            key, sep, value = line.rstrip("\n").partition(" ")
            whole = value.strip()
            m = _ARK_REF.match(whole)
            # a plain path (ESPnet2's NpyScpWriter: ``key /dir/key.npy``) names the file whole;
            # else ``ark:offset[range]``; a plain path ending in ``:<digits>`` is looked up whole first
            for target, tail in ((whole, ""), *(((m["path"], f":{m['offset']}{m['range'] or ''}"),) if m else ())):
                published = targets.get(target) or targets.get(os.path.realpath(target))
                if published is not None:
                    line = f"{key}{sep}{published}{tail}\n"
                    changed, rewritten = True, rewritten + 1
                    break
            else:
                named = m["path"] if m else whole
                if any(named == r or named.startswith(r + os.sep) for r in roots):
                    raise RuntimeError(f"{path.name}:{lineno}: {named} is in the staging directory but is "
                                       "not published; an scp must name files that are published with it")
            lines.append(line)
        if changed:
            path.write_text("".join(lines), encoding="utf-8")
    return rewritten


def scp_offsets(text: str, where: str) -> dict[str, str]:
    """Key → ``offset`` (with its ``[range]``, if any) of each line of an scp into one ark: what a
    merge needs to point the lines at the ark's published URI, whatever path the scp names
    (a ``done`` record from before scps were published pointing at their arks names a staging path).

    Raises:
        RuntimeError: a line that names no ``path:offset`` (``where`` names the shard).
    """
    offsets = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        key, _, value = line.partition(" ")
        m = _ARK_REF.match(value.strip())
        if m is None:
            raise RuntimeError(f"{where}: feats.scp line {lineno} is not 'key ark:offset': {line!r}")
        offsets[key] = m["offset"] + (m["range"] or "")
    return offsets
