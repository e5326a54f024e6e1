"""In-memory classes and splits (tasks/maml/classes.py): bad image arrays, non-square rotations and leaking splits
refused by name."""
from __future__ import annotations

import numpy as np
import pytest

from learn2stop.tasks.maml.classes import ClassImages, DataError, RotatedClasses, check_disjoint


# ----------------------------------------------------------------------------- in-memory classes and splits
@pytest.mark.parametrize("shape, names, match", [
    ((3, 2, 5, 5), ["a", "b", "a"], r"class names must be unique .*given twice: 'a'"),
    ((3, 2, 5, 5), ["a", "b"], r"2 class names for 3 classes"),
    ((3, 0, 5, 5), ["a", "b", "c"], r">= 1 image per class"),
    ((3, 2, 5, 5, 4), ["a", "b", "c"], r"images must be \(classes, per_class, H, W\[, 3\]\); got shape \(3, 2, 5, 5, 4\)"),
    ((3, 2, 5), ["a", "b", "c"], r"images must be \(classes, per_class, H, W\[, 3\]\)"),
])
def test_class_images_refuse_bad_arrays(shape, names, match):
    with pytest.raises(DataError, match=match):
        ClassImages(np.zeros(shape, np.uint8), names)


def test_rotations_need_square_images():
    with pytest.raises(DataError, match=r"rotation augmentation needs square images; got 5x7"):
        RotatedClasses(ClassImages(np.zeros((2, 2, 5, 7), np.uint8), ["a", "b"]))


@pytest.mark.parametrize("splits, match", [
    ({"train": ["a", "b"], "val": ["c"], "test": ["b", "d"]}, r"1 of the characters are in both the train and the test split: 'b'"),
    ({"train": ["a", "b"], "val": ["a", "c"], "test": ["d"]}, r"in both the train and the val split: 'a'"),
    ({"train": ["a", "a"], "val": ["c"], "test": ["d"]}, r"the train split lists 1 of the characters twice: 'a'"),
])
def test_check_disjoint_names_the_leak(splits, match):
    with pytest.raises(DataError, match=match):
        check_disjoint(splits, "characters")
