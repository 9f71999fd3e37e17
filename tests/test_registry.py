"""The one registry helper every extension point uses (entry points: ``tests/test_plugins.py``)."""

from __future__ import annotations

import pytest

from espnet3_flows.config import ConfigError
from espnet3_flows.registry import ENTRY_POINT_GROUPS, Registry, instance_of


class Shape:
    name = ""


class Square(Shape):
    name = "square"


class Circle(Shape):
    name = "circle"


#: a table of entries, as a module may declare several (``parallel.backends.jobqueue``'s schedulers)
POLYGONS = {"triangle": type("Triangle", (Shape,), {"name": "triangle"})(), "square": Square()}


def test_builtins_load_once_on_first_use_and_unknown_names_get_the_closest():
    loaded = []

    def builtins():  # (a scan, as the jobs' packages are found)
        loaded.append(1)
        return [f"{__name__}:Circle", f"{__name__}:Square"]

    shapes = Registry("frontend", "shape.type", builtins=builtins, accept=instance_of(Shape),
                      group="espnet3_flows.test_shapes_none")
    assert loaded == []  # nothing imported until asked
    assert shapes.names() == ("circle", "square") and loaded == [1]
    assert isinstance(shapes.get("square"), Square) and shapes.is_builtin("square")
    with pytest.raises(ConfigError, match=r"shape.type: unknown frontend 'sqare' \(did you mean 'square'\?\); "
                                          r"known: circle, square"):
        shapes.get("sqare")
    assert loaded == [1]
    shapes.register("triangle", Shape())
    assert "triangle" in shapes and not shapes.is_builtin("triangle")
    shapes.unregister("triangle")
    assert "triangle" not in shapes and shapes.find("triangle") is None


def test_builtins_are_references_loaded_in_their_order_and_checked_as_a_plugins_are():
    """Built-in entries are declared as an entry point declares a plugin's (``module:attr``, a
    class, an instance or a table of them), registered in the declared order whatever was imported
    first, and refused by ``accept`` as a plugin's would be."""
    shapes = Registry("frontend", "shape.type", accept=instance_of(Shape), group="espnet3_flows.test_shapes_none",
                      builtins=(f"{__name__}:POLYGONS", f"{__name__}:Circle"))
    shapes.register("hexagon", Shape())  # a program's own entry comes after the built-in ones
    assert shapes.names() == ("triangle", "square", "circle", "hexagon")
    assert shapes.get("square") is POLYGONS["square"] and isinstance(shapes.get("circle"), Circle)
    broken = Registry("frontend", "shape.type", accept=instance_of(Square), group="espnet3_flows.test_shapes_none",
                      builtins=(f"{__name__}:Circle",))
    with pytest.raises(TypeError, match="is not a"):
        broken.names()
    table = Registry("frontend", "shape.type", accept=instance_of(Shape), group="espnet3_flows.test_shapes_none",
                     builtins={"circle": f"{__name__}:Circle", "square": f"{__name__}:Square"})
    assert table.names() == ("circle", "square")  # a {name: reference} table, as entry points are declared
    misnamed = Registry("frontend", "shape.type", accept=instance_of(Shape), group="espnet3_flows.test_shapes_none",
                        builtins={"round": f"{__name__}:Circle"})
    with pytest.raises(TypeError, match="named 'round' but its object 'circle'"):
        misnamed.names()


def test_instance_of_takes_a_subclass_or_an_instance_of_the_right_name():
    accept = instance_of(Shape)
    assert isinstance(accept("square", Square), Square) and isinstance(accept("square", Square()), Square)
    with pytest.raises(TypeError, match="not a"):
        accept("square", object())
    with pytest.raises(TypeError, match="named 'round' but its object 'square'"):
        accept("round", Square)


def test_every_extension_point_has_its_group():
    assert set(ENTRY_POINT_GROUPS.values()) == {"espnet3_flows.jobs", "espnet3_flows.formats",
                                                "espnet3_flows.backends", "espnet3_flows.frontends",
                                                "espnet3_flows.xvector_toolkits"}
    from espnet3_flows.frontends.config import FRONTENDS
    from espnet3_flows.inputs.formats import FORMATS
    from espnet3_flows.job_registry import JOBS
    from espnet3_flows.parallel.backends import BACKENDS
    from espnet3_flows.xvector.toolkits import TOOLKITS

    registries = (JOBS, FORMATS, BACKENDS, FRONTENDS, TOOLKITS)
    assert sorted(r.group for r in registries) == sorted(ENTRY_POINT_GROUPS.values())
    assert [sorted(r.names(plugins=False)) for r in (FRONTENDS, TOOLKITS)] == [
        ["espnet2", "fbank", "model", "none"], ["custom", "espnet", "rawnet", "speechbrain"]]


def test_each_builtin_frontend_and_toolkit_is_a_module_of_its_own():
    """One module per built-in entry (the declaration; the heavy implementation stays on workers):
    adding or removing one touches its module and the registry's list, nothing else."""
    import subprocess
    import sys

    from espnet3_flows.frontends.config import FRONTENDS
    from espnet3_flows.xvector.toolkits import TOOLKITS

    frontends = {n: type(FRONTENDS.get(n)).__module__ for n in FRONTENDS.names(plugins=False)}
    assert frontends == {n: f"espnet3_flows.frontends.{n}_type" for n in ("none", "fbank", "model", "espnet2")}
    toolkits = {n: type(TOOLKITS.get(n)).__module__ for n in TOOLKITS.names(plugins=False)}
    assert toolkits == {n: f"espnet3_flows.xvector.toolkits.{n}" for n in ("speechbrain", "espnet", "rawnet", "custom")}
    # the toolkits' declarations import no torch: the driver reads them to check a config
    code = ("import sys; from espnet3_flows.xvector.toolkits import TOOLKITS; TOOLKITS.names(); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))")
    subprocess.run([sys.executable, "-c", code], check=True)
