"""docs/configuration.md's tables are made from the config classes' docstrings, and neither the
README nor any page of docs/ names a config key that the configs lack."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from espnet3_flows import config_docs
from espnet3_flows.config import describe_keys
from espnet3_flows.job_registry import available_jobs

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
#: every page a user reads: the README and docs/
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))


def test_the_tables_are_what_the_docstrings_make():
    text = PAGE.read_text()
    stale = config_docs.stale_tables(text)
    assert not stale, (f"docs/configuration.md's config tables {stale} differ from the config classes' docstrings (the one "
                       f"source of each key's meaning): run `{config_docs.REGENERATE}` and commit docs/configuration.md")


def test_every_packaged_job_engine_parallel_and_the_envs_have_a_table():
    names = config_docs.table_names(PAGE.read_text())
    packaged = [n for n, spec in available_jobs().items() if spec.schema.startswith("espnet3_flows.")]
    assert sorted(names) == sorted([*packaged, "engine", "parallel", "backends", "env-options"])


@pytest.mark.parametrize("job", sorted(available_jobs()))
def test_every_key_of_every_job_has_a_description(job):
    docs = describe_keys(available_jobs()[job].config_class)
    assert not [key for key, doc in docs.items() if not doc]
    config_docs.config_table(job)  # raises on an undocumented key


def test_rendering_rows_choices_shared_keys_and_escapes():
    table = config_docs.config_table("collect_stats")
    assert "| `on_error` |" not in table and "`on_error`" in table.splitlines()[-1]  # shared: the engine's table
    assert "| `collected_feats_format` | `ark` |" in table and "One of `ark`, `npy`." in table
    assert '| `tokens.token_type` | `""` |' in table and 'One of `""`, `none`, `char`' in table
    assert "| `frontend.channel` | `null` |" in table and "| `write_collected_feats` | `false` |" in table
    assert ":class:" not in table and "``" not in table
    engine = config_docs.config_table("engine")
    assert "`sph2pipe -f wav X.sph \\|`" in engine  # a pipe in a cell is escaped
    assert "| `parallel.*` | |" in engine and "(#parallel-configuration-parallel)" in engine
    xvector = config_docs.config_table("extract_xvectors")
    assert "| `shard_size` | `128` |" in xvector  # a changed engine key is the job's own row
    features = config_docs.config_table("extract_features", ["frontend"])
    assert "| `frontend.*` | |" in features and "frontend.type" not in features.replace("`frontend.frame_shift`", "")
    with pytest.raises(config_docs.ConfigDocsError, match="collapse=nope"):
        config_docs.config_table("extract_features", ["nope"])
    with pytest.raises(config_docs.ConfigDocsError, match="not engine, parallel or a job"):
        config_docs.config_table("collect_stat")


def test_render_replaces_only_between_the_markers():
    text = "intro\n<!-- config-table: parallel -->\nold rows\n<!-- /config-table -->\noutro\n"
    out = config_docs.render(text)
    assert out.startswith("intro\n<!-- config-table: parallel -->\n| key | default | meaning |")
    assert out.endswith("<!-- /config-table -->\noutro\n") and "old rows" not in out
    assert config_docs.stale_tables(text) == ["parallel"] and config_docs.stale_tables(out) == []
    assert config_docs.render(out) == out


def test_check_exits_1_and_names_the_command(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("<!-- config-table: engine -->\n<!-- /config-table -->\n")
    assert config_docs.main(["--check", str(readme)]) == 1
    assert config_docs.REGENERATE in capsys.readouterr().err
    assert config_docs.main([str(readme)]) == 0 and config_docs.main(["--check", str(readme)]) == 0


def _keys() -> tuple[set[str], set[str], set[str]]:
    """Every job's keys (their old spellings, ``CONFIG_ALIASES``, included), the keys whose value
    is a mapping (any key below them is the user's), and the sections (dataclass-valued keys)."""
    keys, mappings, sections = set(), set(), set()

    def walk(schema: type, prefix: str) -> None:
        hints = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            kind, key = hints[f.name], prefix + f.name
            keys.add(key)
            if dataclasses.is_dataclass(kind):
                sections.add(key)
                walk(kind, key + ".")
            elif typing.get_origin(kind) is dict or kind is dict:
                mappings.add(key)

    for spec in available_jobs().values():
        walk(spec.config_class, "")
        keys.update(getattr(spec.config_class, "CONFIG_ALIASES", {}))
    return keys, mappings, sections


def _resolves(key: str, keys: set[str], mappings: set[str], sections: set[str]) -> bool:
    if key in keys or (key.endswith(".*") and key[:-2] in sections):
        return True
    parts = key.split(".")
    return any(".".join(parts[:i]) in mappings for i in range(1, len(parts)))


def test_the_docs_name_no_config_key_the_configs_lack():
    """Keys in prose and examples (``frontend.type``, ``parallel.options.queue=cpu``, the
    ``key=value`` words of the README's command lines) are keys of a job's config."""
    keys, mappings, sections = _keys()
    text = "\n".join(page.read_text() for page in PAGES)
    dotted = re.compile(rf"(?<![\w./-])((?:{'|'.join(sorted(sections))})\.[A-Za-z_*][\w<>]*(?:\.[A-Za-z_<>*][\w<>]*)*)")
    files = {"scp", "ark", "txt", "yaml", "pt", "npz", "json", "tsv", "png", "py", "md"}  # xvector.scp, parallel.py: files
    named = {m.group(1) for m in dotted.finditer(text) if m.group(1).rsplit(".", 1)[-1] not in files}
    unknown = sorted(k for k in named if not _resolves(k, keys, mappings, sections))
    assert not unknown, f"README.md or docs/ name config keys that no job has: {unknown}"
    assert {"frontend.espnet_config", "tokens.token_type", "parallel.options.queue"} <= named  # it looks
    commands = re.sub(r"\\\n\s*", " ", "\n".join(re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.DOTALL)))
    bad = []
    for line in commands.splitlines():
        job = re.search(r"flows/(\w+)\.py|-m espnet3_flows (\w+)", line)
        if not job or (job.group(1) or job.group(2)) not in available_jobs():
            continue
        schema = available_jobs()[job.group(1) or job.group(2)].config_class
        own = set(describe_keys(schema))
        aliases = set(getattr(schema, "CONFIG_ALIASES", {}))
        for word in line.split("#")[0].split()[1:]:
            key = word.strip("'\"").partition("=")[0]
            if "=" in word and not key.startswith("-") and not _resolves(key, own | aliases, mappings | aliases, set()):
                bad.append(f"{key} ({line.strip()[:60]}...)")
    assert not bad, f"the command lines of README.md and docs/ set keys their job lacks: {bad}"


#: what this package tells its own child processes at their start (the forkserver, spawned local
#: workers), never set in the user's process: not settings, so not in the table (named below it)
_HAND_OFFS = {"ESPNET3_FLOWS_QUIET", "ESPNET3_FLOWS_MAIN_STATUS", "ESPNET3_FLOWS_FORKSERVER_MAIN"}


def test_every_environment_variable_the_package_reads_is_in_one_table():
    """The user's variables are documented in one table of docs/configuration.md, and the table
    names no variable the package does not read."""
    used = set()
    for path in (ROOT / "espnet3_flows").rglob("*.py"):
        used |= set(re.findall(r"ESPNET3_FLOWS_[A-Z_]+", path.read_text(encoding="utf-8")))
    section = PAGE.read_text(encoding="utf-8").split("## Environment variables", 1)[1]
    documented = set(re.findall(r"^\| `(ESPNET3_FLOWS_[A-Z_]+)` \|", section, flags=re.MULTILINE))
    assert documented == used - _HAND_OFFS, (documented, used)
    assert all(f"`{name}`" in section for name in _HAND_OFFS), "the child processes' variables are named below it"
