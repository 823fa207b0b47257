"""Registries, auto-import and tagged-union validation (pure logic)."""

from __future__ import annotations

from typing import ClassVar, Literal

import pytest

from speculators_vllm016.utils import (
    ClassRegistryMixin,
    PydanticClassRegistryMixin,
    ReloadableBaseModel,
)


def test_register_by_name_and_by_class_name():
    class Base(ClassRegistryMixin):
        registry: ClassVar = None

    @Base.register("first")
    class First:
        pass

    @Base.register()
    class Second:
        pass

    assert Base.registry == {"first": First, "Second": Second}
    assert Base.registered_classes() == (First, Second)
    with pytest.raises(ValueError, match="already registered"):
        Base.register("first")(Second)
    with pytest.raises(TypeError):
        Base.register_decorator("not a class")


def test_auto_discovery_requires_opt_in():
    class Quiet(ClassRegistryMixin):
        registry: ClassVar = None

    with pytest.raises(ValueError, match="does not auto-discover"):
        Quiet.auto_populate_registry()


def test_schema_base_type_is_abstract_as_in_0_3_0():
    assert "__pydantic_schema_base_type__" in PydanticClassRegistryMixin.__abstractmethods__

    class NoRoot(PydanticClassRegistryMixin):
        kind: str = "x"

    with pytest.raises(TypeError, match="abstract"):
        NoRoot()


def test_tagged_union_validates_into_the_registered_subclass():
    class Shape(PydanticClassRegistryMixin):
        @classmethod
        def __pydantic_schema_base_type__(cls):
            return next(k for k in cls.__mro__ if k.__name__ == "Shape")

        schema_discriminator: ClassVar[str] = "kind"
        registry: ClassVar = None
        kind: str

    class EarlyDrawing(ReloadableBaseModel):  # defined before anything is registered
        shapes: list[Shape]

    @Shape.register("square")
    class Square(Shape):
        kind: Literal["square"] = "square"
        side: float = 1.0

    @Shape.register("circle")
    class Circle(Shape):
        kind: Literal["circle"] = "circle"
        radius: float = 1.0

    class Drawing(ReloadableBaseModel):
        shapes: list[Shape]

    Shape.reload_schema()
    Drawing.reload_schema()
    drawing = Drawing.model_validate(
        {"shapes": [{"kind": "circle", "radius": 2}, {"kind": "square"}]}
    )
    assert [type(s) for s in drawing.shapes] == [Circle, Square]
    assert drawing.shapes[0].radius == 2
    with pytest.raises(Exception, match="triangle"):
        Drawing.model_validate({"shapes": [{"kind": "triangle"}]})
    with pytest.raises(TypeError):
        Shape.register_decorator(int)
    # No schema rebuild needed: the subclass is looked up when the data is validated.
    early = EarlyDrawing.model_validate({"shapes": [{"kind": "square", "side": 3}]})
    assert type(early.shapes[0]) is Square and early.shapes[0].side == 3
