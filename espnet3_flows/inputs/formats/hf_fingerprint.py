"""A saved Hugging Face dataset's fingerprint: the one private name of ``datasets`` this package
reads, behind the patches' switch (:mod:`espnet3_flows.patches`, name ``dataset_fingerprint``).

``Dataset._fingerprint`` is what ``datasets`` itself keys its caches on: a hash of how the
dataset was made, new with every transform; ``datasets`` 3 to 5 have no public accessor. It is
read where the installed ``datasets`` is a major version it was checked against
(:data:`VERIFIED_MAJORS`; ``tests/test_patch_targets.py`` checks the attribute) and the switch
allows it. Otherwise the fingerprint is made from public facts only: the dataset's Arrow files
(``Dataset.cache_files``) with their sizes and modification times, its rows and columns; it
changes whenever the data on disk does. The two kinds never compare equal (the public one starts
with :data:`PUBLIC_PREFIX`), so a run planned with one kind and read with the other says the
dataset changed instead of reading rows it did not plan.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from espnet3_flows.hashing import token

#: ``datasets`` major versions whose ``Dataset._fingerprint`` was checked (3, 4 and 5)
VERIFIED_MAJORS = range(3, 6)
#: how a fingerprint made from public facts begins
PUBLIC_PREFIX = "files-"
_LOG = logging.getLogger(__name__)
_WARNED: list[str] = []


def dataset_fingerprint(ds: Any) -> str:
    """``ds``'s fingerprint: ``datasets``' own where that may be read (see the module), else
    :func:`public_fingerprint`."""
    import datasets

    from espnet3_flows.patches import patches_enabled

    if not patches_enabled("dataset_fingerprint"):
        return public_fingerprint(ds)
    private = getattr(ds, "_fingerprint", None)
    major = int(str(datasets.__version__).split(".")[0])
    if major in VERIFIED_MAJORS and isinstance(private, str) and private:
        return private
    if not _WARNED:
        _WARNED.append(datasets.__version__)
        _LOG.warning("datasets %s is not a version whose Dataset._fingerprint espnet3_flows checked (%d to %d): "
                     "fingerprints come from the dataset's files instead", datasets.__version__,
                     VERIFIED_MAJORS.start, VERIFIED_MAJORS.stop - 1)
    return public_fingerprint(ds)


def public_fingerprint(ds: Any) -> str:
    """A fingerprint of ``ds`` from its public attributes: its Arrow files' names, sizes and
    modification times (``cache_files``), its number of rows and its columns."""
    files = []
    for entry in ds.cache_files:
        state = os.stat(entry["filename"])
        files.append([entry["filename"], state.st_size, state.st_mtime_ns])
    return PUBLIC_PREFIX + token("hf-dataset-files", [files, ds.num_rows, list(ds.column_names)], 16)
