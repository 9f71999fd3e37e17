"""A model directory copied from another machine: the files each toolkit needs, and an error that
lists every missing one. speechbrain's own loader is the truth for what a directory needs: each
file our check asks for is one speechbrain cannot load without (offline), and a file it does not
ask for may be left out."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from espnet3_flows.xvector import XVectorModelError, load_speechbrain_encoder
from espnet3_flows.xvector import model as xvector_model
from espnet3_flows.xvector.espnet_spk import resolve_espnet_model
from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir
from espnet3_flows.xvector.random_spk import build_random_espnet_spk, build_random_rawnet3
from espnet3_flows.xvector.rawnet3 import load_recipe_rawnet3

ROOT = Path(__file__).resolve().parents[2]
ECAPA_FILES = ["hyperparams.yaml", "embedding_model.ckpt", "mean_var_norm_emb.ckpt", "classifier.ckpt"]


@pytest.fixture(scope="module")
def ecapa(tmp_path_factory) -> Path:
    model = build_random_ecapa_dir(tmp_path_factory.mktemp("ecapa") / "model")
    (model / "README.md").write_text("a model card: not a model file\n")
    return model


def _copy_without(src: Path, dst: Path, name: str) -> Path:
    shutil.copytree(src, dst)
    (dst / name).unlink()
    return dst


def test_the_files_hyperparams_yaml_loads_are_listed(ecapa):
    assert xvector_model.speechbrain_model_files((ecapa / "hyperparams.yaml").read_text()) == ECAPA_FILES


@pytest.mark.parametrize("name", ECAPA_FILES[1:])
def test_a_speechbrain_directory_without_one_file_is_refused_naming_it_and_speechbrain_agrees(
        ecapa, tmp_path, monkeypatch, name):
    partial = _copy_without(ecapa, tmp_path / "copy", name)
    with pytest.raises(XVectorModelError) as info:
        load_speechbrain_encoder(partial, savedir=tmp_path / "save")
    assert f"lacks 1 file(s) its hyperparams.yaml loads: {name};" in str(info.value)
    # without our check, speechbrain's offline loader fails on the same directory
    monkeypatch.setattr(xvector_model, "_complete", lambda local, source: local)
    with pytest.raises(XVectorModelError, match="could not load the speechbrain model"):
        load_speechbrain_encoder(partial, savedir=tmp_path / "save2")


def test_every_missing_file_is_listed_at_once_and_optional_files_may_be_left_behind(ecapa, tmp_path):
    partial = _copy_without(ecapa, tmp_path / "copy", "classifier.ckpt")
    (partial / "embedding_model.ckpt").unlink()
    with pytest.raises(XVectorModelError, match=r"lacks 2 file\(s\) its hyperparams.yaml loads: "
                                                r"embedding_model.ckpt, classifier.ckpt;"):
        load_speechbrain_encoder(partial, savedir=tmp_path / "save")
    # a model card, and the label encoder (speechbrain loads it only if it is there), may stay behind
    for name in ("README.md", "label_encoder.txt"):
        load_speechbrain_encoder(_copy_without(ecapa, tmp_path / f"no-{name}", name), savedir=tmp_path / f"s-{name}")


def test_espnet_spk_and_rawnet3_name_each_missing_file(tmp_path):
    weights = build_random_espnet_spk(tmp_path / "spk")
    assert resolve_espnet_model(str(tmp_path / "spk")).weights == weights.resolve()
    (tmp_path / "spk" / "config.yaml").unlink()
    with pytest.raises(XVectorModelError, match=r"its config.yaml '.*/spk/config.yaml' does not exist"):
        resolve_espnet_model(str(weights))
    weights.unlink()
    with pytest.raises(XVectorModelError, match=r"must hold one .pth beside its config.yaml \(found: none\)"):
        resolve_espnet_model(str(tmp_path / "spk"))
    rawnet = build_random_rawnet3(tmp_path / "rawnet" / "model.pt")
    load_recipe_rawnet3(rawnet)
    rawnet.unlink()
    with pytest.raises(XVectorModelError, match="does not exist"):
        load_recipe_rawnet3(rawnet)


def test_the_docs_list_the_files_the_check_asks_for():
    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text[text.index("### A model from another machine"):]
    section = section[:section.index("\n## ") if "\n## " in section else len(section)]
    for name in ECAPA_FILES:
        assert f"`{name}`" in section, name
    for name in ("config.yaml", ".pth", "model.pt", "meta.yaml"):
        assert name in section, name
