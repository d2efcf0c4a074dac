"""How `auto` maps a shape to a class and a class to the kernel measured fastest."""

from __future__ import annotations

import pytest

from app.engine.autotune import SHAPE_CLASSES, AutoChoice, pick_auto, shape_class_of
from numerics.precision import Precision


@pytest.mark.parametrize(
    ("shape", "expected"),
    [((1, 1, 1), "small"), ((384, 384, 384), "small"), ((385, 384, 384), "medium"), ((4096, 1, 4096), "small"),
     ((2048, 2048, 2048), "large"), ((8192, 8192, 8192), "huge"), ((0, 5, 5), "small")],
)  # fmt: skip
def test_a_shape_falls_in_the_class_of_its_cube_root(shape: tuple[int, int, int], expected: str) -> None:
    assert shape_class_of(*shape).name == expected


def test_auto_picks_the_measured_choice_of_the_class_and_falls_back_before_measuring() -> None:
    choices = [AutoChoice(shape_class=c, kernel=f"k-{c.name}", probe_ms={}) for c in SHAPE_CLASSES]
    assert pick_auto(choices, 1024, 1024, 1024, fallback="cublas") == "k-medium"
    assert pick_auto([], 1024, 1024, 1024, fallback="cublas") == "cublas"


def test_every_size_has_a_class_and_probes_lie_inside_their_class() -> None:
    assert SHAPE_CLASSES[-1].up_to is None
    for shape_class in SHAPE_CLASSES:
        assert shape_class_of(shape_class.probe, shape_class.probe, shape_class.probe) == shape_class


def test_float64_takes_its_own_choices_where_measured_and_float32_s_where_not() -> None:
    medium = SHAPE_CLASSES[1]
    float32 = AutoChoice(shape_class=medium, kernel="fast", probe_ms={})
    float64 = AutoChoice(shape_class=medium, kernel="dmma", probe_ms={}, dtype="float64")
    bf16 = AutoChoice(shape_class=medium, kernel="wgmma", probe_ms={}, precision=Precision.BF16)
    assert pick_auto([float32, float64, bf16], 1024, 1024, 1024, "cublas", dtype="float64") == "dmma"
    assert pick_auto([float32, float64, bf16], 1024, 1024, 1024, "cublas", dtype="float32") == "fast"
    assert pick_auto([float32, bf16], 1024, 1024, 1024, "cublas", dtype="float64") == "fast"
    assert pick_auto([float32, float64, bf16], 1024, 1024, 1024, "cublas", precision=Precision.BF16) == "wgmma"
    assert pick_auto([float64], 1024, 1024, 1024, "cublas", precision=Precision.TF32, dtype="float64") == "cublas"


def test_a_stack_gets_the_fastest_measured_of_the_kernels_that_take_stacks() -> None:
    """`fast` won the class but does not take stacks: a stack gets the fastest of those that do, and the fallback
    where none of them was measured."""
    small = SHAPE_CLASSES[0]
    choice = AutoChoice(shape_class=small, kernel="fast", probe_ms={"fast": 0.01, "tiled": 0.03, "cublas": 0.02})
    assert pick_auto([choice], 64, 64, 64, "cublas") == "fast"
    assert pick_auto([choice], 64, 64, 64, "cublas", among=["tiled", "cublas"]) == "cublas"
    assert pick_auto([choice], 64, 64, 64, "cublas", among=["tiled"]) == "tiled"
    assert pick_auto([choice], 64, 64, 64, "naive", among=["blocktile1d"]) == "naive"
