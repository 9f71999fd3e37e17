"""No file outside ``output_dir`` is deleted, replaced or created by a run, whatever a record names
and whatever the output tree holds: a directory of the tree that is a symbolic link to elsewhere
is refused (one ``error:`` line naming the path and the link, nothing changed there), a link in
place of a file is replaced or unlinked, never written through, and a ``..`` in a record's name
never leads out (on disk, on object stores, into a merge's local copies). ``output_dir`` itself
may be a link."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from espnet3_flows.confinement import OutsideOutputError
from espnet3_flows.config import load_config
from espnet3_flows.orchestration.job_run import plan_job
from espnet3_flows.parallel.scheduler import InProcessExecutor, run_planned
from espnet3_flows.storage import Storage
from tests.support.servers import cli_env

ROOT = Path(__file__).resolve().parents[2]


def _run(manifest: str, out: Path) -> None:
    from espnet3_flows.orchestration.jobs import get_job

    cfg = load_config(get_job("collect_stats").config_class,
                      overrides=[f"manifests.train={manifest}", f"output_dir={out}", "shard_size=8",
                                 "parallel.env=serial"])
    run = plan_job("collect_stats", cfg)
    if run.unchanged_summaries is None:
        run_planned(run.runners, InProcessExecutor(), progress=False)


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every entry below ``root`` (a link as its target, not followed), with the files' bytes."""
    return {p.relative_to(root).as_posix(): (f"-> {p.readlink()}" if p.is_symlink() else p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_symlink() or p.is_file()}


def _outputs(out: Path) -> dict[str, bytes]:
    return {name: (out / "train" / name).read_bytes() for name in ("feats_shape", "speech_shape", "feats_stats.npz")}


@pytest.fixture
def merged(demo_corpus, tmp_path):
    """A finished run (``exp``), its merged outputs, and a directory elsewhere holding a victim file."""
    out = tmp_path / "exp"
    _run(demo_corpus["valid"], out)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "victim_del.txt").write_text("not the run's")
    return out, _outputs(out), elsewhere


def _merging_record(out: Path, *extra: str) -> None:
    """``summary.json`` as a merge that stopped half-way leaves it, naming ``extra`` files too."""
    summary = json.loads((out / "train" / "summary.json").read_text())
    files = {**summary["files"], **{name: "x" for name in extra}}
    (out / "train" / "summary.json").write_text(json.dumps({"split": "train", "merging": True, "files": files}))


def test_a_stale_name_through_a_linked_directory_is_refused_and_nothing_is_changed(demo_corpus, merged):
    """The issue's case: ``train/evil`` links elsewhere, a ``merging`` record names
    ``evil/victim_del.txt``; the rerun deleted the file outside (exit 0)."""
    out, before, elsewhere = merged
    (out / "train" / "evil").symlink_to(elsewhere)
    _merging_record(out, "evil/victim_del.txt", "evil/absent.txt")
    outside, inside = _tree(elsewhere), _tree(out / "train")
    with pytest.raises(OutsideOutputError) as err:
        _run(demo_corpus["valid"], out)
    message = str(err.value)
    assert f"{out}/train/evil/" in message and f"{out}/train/evil is a symbolic link to {elsewhere}" in message
    assert _tree(elsewhere) == outside and (elsewhere / "victim_del.txt").read_text() == "not the run's"
    assert _tree(out / "train") == inside  # refused before the merge changed anything: still `merging`
    (out / "train" / "evil").unlink()  # the link removed, the rerun merges as before
    _run(demo_corpus["valid"], out)
    assert _outputs(out) == before and "merging" not in json.loads((out / "train" / "summary.json").read_text())


@pytest.mark.prefect
def test_the_cli_ends_in_one_line_naming_the_path_and_the_link(demo_corpus, merged, tmp_path, session_api_url):
    out, _, elsewhere = merged
    (out / "train" / "evil").symlink_to(elsewhere)
    _merging_record(out, "evil/victim_del.txt")
    args = [f"manifests.train={demo_corpus['valid']}", f"output_dir={out}", "shard_size=8", "parallel.env=serial"]
    proc = subprocess.run([sys.executable, "-m", "espnet3_flows", "collect_stats", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env=cli_env(tmp_path / "prefect-home", HF_HUB_OFFLINE="1", api_url=session_api_url))
    text = proc.stdout + proc.stderr
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in text, text
    assert "OutsideOutputError" in errors[0] and f"{out}/train/evil is a symbolic link to {elsewhere}" in errors[0]
    assert (elsewhere / "victim_del.txt").read_text() == "not the run's"


def test_a_linked_file_in_place_of_an_output_is_replaced_or_unlinked_never_followed(demo_corpus, merged):
    """A link in place of a merged file is replaced by the file (ESPnet recipes link a pretrained
    ``feats_stats.npz``); one a record names as stale is unlinked: what they point at stays."""
    out, before, elsewhere = merged
    victim = elsewhere / "victim_del.txt"
    (out / "train" / "feats_shape").unlink()
    (out / "train" / "feats_shape").symlink_to(victim)
    (out / "train" / "gone.txt").symlink_to(victim)
    _merging_record(out, "gone.txt")
    _run(demo_corpus["valid"], out)
    assert victim.read_text() == "not the run's" and _tree(elsewhere) == {"victim_del.txt": b"not the run's"}
    assert not (out / "train" / "feats_shape").is_symlink() and _outputs(out) == before
    assert not (out / "train" / "gone.txt").exists() and not (out / "train" / "gone.txt").is_symlink()


def _a_shard(out: Path) -> Path:
    return sorted((out / "train" / "shards").glob("split.*"))[0]


def test_a_linked_shard_directory_is_refused_and_nothing_outside_is_created(demo_corpus, merged):
    """A shard's directory moved elsewhere and linked back, its ``done`` record gone: the shard is
    computed and its publishing refused; nothing is created, replaced or removed there."""
    out, _, elsewhere = merged
    shard = _a_shard(out)
    moved = elsewhere / shard.name
    shutil.move(shard, moved)
    (moved / "done").unlink()
    (moved / "shapes.tsv").write_text("not the run's\n")
    shard.symlink_to(moved)
    outside = _tree(elsewhere)
    with pytest.raises(Exception) as err:
        _run(demo_corpus["valid"], out)
    assert f"{shard} is a symbolic link to {moved}" in str(err.value)
    assert isinstance(err.value, OutsideOutputError) or isinstance(err.value.__cause__, OutsideOutputError)
    assert _tree(elsewhere) == outside


def test_a_linked_file_in_place_of_a_shard_file_is_replaced_never_written_through(demo_corpus, merged):
    out, before, elsewhere = merged
    shard = _a_shard(out)
    victim = elsewhere / "victim_del.txt"
    (shard / "shapes.tsv").unlink()
    (shard / "shapes.tsv").symlink_to(victim)  # no longer matches its done record: the shard is computed again
    _merging_record(out)  # (and the split merged again: a complete record of the same plan is trusted as it is)
    _run(demo_corpus["valid"], out)
    assert _tree(elsewhere) == {"victim_del.txt": b"not the run's"}
    assert not (shard / "shapes.tsv").is_symlink() and _outputs(out) == before


def test_a_linked_split_directory_is_refused_before_anything_is_written(demo_corpus, tmp_path):
    out, elsewhere = tmp_path / "exp", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "train").symlink_to(elsewhere)
    with pytest.raises(OutsideOutputError, match=f"{out}/train is a symbolic link to {elsewhere}"):
        _run(demo_corpus["valid"], out)
    assert list(elsewhere.iterdir()) == []


def test_a_linked_output_dir_itself_is_a_legitimate_place(demo_corpus, tmp_path):
    real, link = tmp_path / "disk" / "exp", tmp_path / "exp"
    real.mkdir(parents=True)
    link.symlink_to(real)
    _run(demo_corpus["valid"], link)
    assert (real / "train" / "summary.json").is_file() and (real / "train" / "feats_stats.npz").is_file()


# -- names from records, directly at the storage layer -------------------------------------------------


@pytest.mark.parametrize("local", [True, False], ids=["disk", "memory"])
def test_a_name_that_leaves_the_root_is_refused_for_every_write_and_removal(tmp_path, local):
    url = str(tmp_path / "out") if local else f"memory://confine-{uuid.uuid4().hex}/out"
    store = Storage(url)
    store.write_bytes("keep.txt", b"mine")
    sibling = store.root.rsplit("/", 1)[0] + "/victim.txt"
    store.fs.pipe_file(sibling, b"not the run's")
    staged = tmp_path / "staged"
    staged.write_bytes(b"x")
    for write in (lambda: store.write_bytes("../victim.txt", b"x"), lambda: store.write_json("a/../../victim.txt", {}),
                  lambda: store.publish_file(staged, "../victim.txt"), lambda: store.create_json("../victim.txt", {}),
                  lambda: store.remove("..", "victim.txt"), lambda: store.remove_tree("..")):
        with pytest.raises(OutsideOutputError, match="leaves"):
            write()
    with pytest.raises(OutsideOutputError), store.atomic_writer("../victim.txt") as f:
        f.write(b"x")
    assert store.fs.cat_file(sibling) == b"not the run's" and store.read_bytes("keep.txt") == b"mine"
    if local:  # a '..' that stays inside is a name like another (an object store keeps it in the key)
        store.write_bytes("a/../inside.txt", b"ok")
        assert store.read_bytes("inside.txt") == b"ok"


def test_a_merge_of_a_remote_output_never_downloads_outside_its_local_copy(tmp_path):
    """A ``done`` record's file names are where a remote merge downloads them to (its local copy)."""
    from espnet3_flows.parallel.merge_step import _fetch

    store = Storage(f"memory://confine-{uuid.uuid4().hex}/out")
    store.fs.pipe_file(store.path("../escaped.txt"), b"from the record")  # the key, as the record names it
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for rel in ("../escaped.txt", str(tmp_path / "absolute.txt")):
        with pytest.raises(OutsideOutputError):
            _fetch(store, rel, mirror)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mirror"] and list(mirror.iterdir()) == []


def test_an_xvector_merge_copies_a_shard_only_inside_its_scratch_directory(tmp_path):
    """A shard's name comes from its ``done`` record; a remote x-vector merge downloads its ark to,
    and removes it from, ``<scratch>/<name>.ark``."""
    from espnet3_flows.parallel.results import ShardResult
    from espnet3_flows.sharding import Shard
    from espnet3_flows.xvector.publish import _shard_embeddings

    store = Storage(f"memory://confine-{uuid.uuid4().hex}/out")
    store.write_bytes("train/shards/x/xvector.ark", b"not an ark")
    scratch = tmp_path / "a" / "scratch"
    (scratch / "split.").mkdir(parents=True)  # (the kernel walks '..' only from a directory that exists)
    victim = tmp_path / "a" / "victim.ark"
    victim.write_bytes(b"not the run's")
    result = ShardResult(Shard(0, 0, 1, "/../../victim"), {}, ["train/shards/x/xvector.ark"])
    assert Path(f"{scratch}/{result.shard.name}.ark").resolve() == victim
    with pytest.raises(OutsideOutputError):
        _shard_embeddings(store, result, scratch)
    assert victim.read_bytes() == b"not the run's" and [p.name for p in scratch.iterdir()] == ["split."]

