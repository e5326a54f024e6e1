"""Bad data: misaligned or duplicated names, leaking splits, odd image sizes; each refused by name."""
from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
from PIL import Image

from learn2stop.tasks.denoise.images import (ImageDataError, check_image_size, load_folder, load_image, save_image)
from learn2stop.tasks.maml.classes import ClassImages, DataError, RotatedClasses, check_disjoint
from learn2stop.tasks.maml.data import MiniImagenet
from learn2stop.tasks.maml.omniglot import load_omniglot_folders, load_omniglot_npz


# ----------------------------------------------------------------------------- Omniglot .npz
def write_npz(root, names_bg, names_ev, drawings=3, side=28, alphabet_len=None, character_len=None, extra=None):
    """Write background/evaluation .npz with the given 'Alphabet/character' names."""
    root.mkdir(parents=True, exist_ok=True)
    for part, names in (("background", names_bg), ("evaluation", names_ev)):
        imgs = np.full((len(names), drawings, side, side), 255, dtype=np.uint8)
        for c in range(len(names)):
            imgs[c, :, 0, 0] = c
        alph = np.array([n.split("/")[0] for n in names])
        char = np.array([n.split("/")[1] for n in names])
        if part == "background" and alphabet_len is not None:
            alph = alph[:alphabet_len]
        if part == "background" and character_len is not None:
            char = np.concatenate([char, char[:character_len - len(char)]]) if character_len > len(char) else char[:character_len]
        np.savez(root / f"{part}.npz", images=imgs, alphabet=alph, character=char, **(extra or {}))
    return root


GOOD_BG = [f"Alpha/character{i:02d}" for i in range(6)]
GOOD_EV = [f"Beta/character{i:02d}" for i in range(4)]


def test_good_npz_splits_are_disjoint_and_cover_everything(tmp_path):
    root = write_npz(tmp_path / "o", GOOD_BG, GOOD_EV)
    parts = [load_omniglot_npz(root, s, image_size=28) for s in ("train", "val", "test")]
    assert sorted(n for p in parts for n in p.names) == sorted(GOOD_BG + GOOD_EV)
    assert parts[0].image_shape == (1, 28, 28)


@pytest.mark.parametrize("bg, ev, match", [
    (GOOD_BG[:5] + [GOOD_BG[0]], GOOD_EV, r"1 character name\(s\) occur twice in the data .*'Alpha/character00'"),
    (GOOD_BG, GOOD_EV[:3] + [GOOD_BG[2]], r"occur twice in the data .*'Alpha/character02'"),
    (GOOD_BG[:5] + ["/character99"], GOOD_EV, r"background\.npz: 1 character\(s\) with an empty alphabet or character name"),
    (GOOD_BG[:1], GOOD_EV[:1], r"2 characters are too few for train/val/test splits: the test split"),
])
def test_npz_duplicate_blank_or_too_few_names(tmp_path, bg, ev, match):
    root = write_npz(tmp_path / "o", bg, ev)
    with pytest.raises(DataError, match=match):
        load_omniglot_npz(root, "train")


@pytest.mark.parametrize("kw, match", [
    ({"alphabet_len": 5}, r"background\.npz: misaligned arrays: 6 characters of images, alphabet \(5,\), character \(6,\)"),
    ({"character_len": 7}, r"background\.npz: misaligned arrays: 6 characters of images, alphabet \(6,\), character \(7,\)"),
])
def test_npz_misaligned_name_arrays(tmp_path, kw, match):
    root = write_npz(tmp_path / "o", GOOD_BG, GOOD_EV, **kw)
    with pytest.raises(DataError, match=match):
        load_omniglot_npz(root, "test")


def test_npz_image_size_must_match_the_model(tmp_path):
    root = write_npz(tmp_path / "o", GOOD_BG, GOOD_EV, side=20)
    with pytest.raises(DataError, match=r"the \.npz images are 20x20, but data\.image_size is 28"):
        load_omniglot_npz(root, "train", image_size=28)


def test_npz_background_and_evaluation_sizes_differ(tmp_path):
    root = write_npz(tmp_path / "o", GOOD_BG, GOOD_EV)
    np.savez(root / "evaluation.npz", images=np.zeros((4, 3, 20, 20), np.uint8),
             alphabet=np.array(["Beta"] * 4), character=np.array([f"c{i}" for i in range(4)]))
    with pytest.raises(DataError, match="background and evaluation images differ in shape"):
        load_omniglot_npz(root, "train")


def test_split_file_listing_a_character_twice_names_it(tmp_path):
    root = write_npz(tmp_path / "o", GOOD_BG, GOOD_EV)
    (root / "maml_split.txt").write_text("\n".join(GOOD_BG + GOOD_EV + [GOOD_EV[1]]) + "\n")
    with pytest.raises(DataError, match=r"lists a character twice: 'Beta/character01'"):
        load_omniglot_npz(root, "train")


def test_split_file_not_utf8(tmp_path):
    root = write_npz(tmp_path / "o", GOOD_BG, GOOD_EV)
    (root / "maml_split.txt").write_bytes(b"Alpha/caf\xe9\n")
    with pytest.raises(DataError, match=r"maml_split\.txt is unreadable or not UTF-8"):
        load_omniglot_npz(root, "train")


# ----------------------------------------------------------------------------- Omniglot PNG folders
def test_png_folders_with_one_character_in_both_parts(tmp_path):
    for part in ("images_background", "images_evaluation"):
        for c in ("character01", "character02"):
            d = tmp_path / part / "Alpha" / c
            d.mkdir(parents=True)
            Image.fromarray(np.ones((10, 10), dtype=bool)).save(d / "a_01.png")
    with pytest.raises(DataError, match=r"character 'Alpha/character01' is in both images_background/ and images_evaluation/"):
        load_omniglot_folders(tmp_path, "train")


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


# ----------------------------------------------------------------------------- MiniImagenet
def write_mini(root, rows_by_split, size=8):
    (root / "images").mkdir(parents=True)
    for split, rows in rows_by_split.items():
        with open(root / f"{split}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["filename", "label"])
            for name, label in rows:
                if not (root / "images" / name).exists():
                    Image.fromarray(np.zeros((size, size, 3), np.uint8)).save(root / "images" / name)
                w.writerow([name, label])
    return root


GOOD_MINI = {"train": [("a1.jpg", "n01"), ("a2.jpg", "n01")], "val": [("b1.jpg", "n02")], "test": [("c1.jpg", "n03")]}


@pytest.mark.parametrize("change, split, match", [
    ({"train": GOOD_MINI["train"] + [("a1.jpg", "n09")]}, "train",
     r"train\.csv line 4: a1\.jpg is listed twice \(first on line 2\); one image must have one label"),
    ({"test": [("c1.jpg", "n01")]}, "train", r"1 of the classes are in both the train and the test split: 'n01'"),
    ({"val": [("a2.jpg", "n02")]}, "val", r"1 of the image files are in both the val and the train split: 'a2\.jpg'"),
    ({"val": [("", "n02")]}, "val", r"val\.csv line 2: expected 'filename,label'"),
])
def test_miniimagenet_duplicates_and_leaks(tmp_path, change, split, match):
    root = write_mini(tmp_path / "m", {**GOOD_MINI, **change})
    with pytest.raises(DataError, match=match):
        MiniImagenet(root, split, image_size=8)


def test_good_miniimagenet_has_one_image_shape(tmp_path):
    ds = MiniImagenet(write_mini(tmp_path / "m", GOOD_MINI), "train", image_size=12)
    assert ds.image_shape == (3, 12, 12) and ds.images(0, torch.tensor([0, 1])).shape == (2, 3, 12, 12)


# ----------------------------------------------------------------------------- denoising images
@pytest.mark.parametrize("shape", [(1, 9), (9, 1), (1, 1), (1, 1, 1, 6), (1, 4, 5)])
def test_thin_and_single_pixel_images_keep_their_orientation(tmp_path, shape):
    img = torch.rand(shape)
    save_image(img, tmp_path / "x.png")
    back = load_image(tmp_path / "x.png")
    expected = img.reshape(shape[-2:]).numpy()
    assert back.shape == shape[-2:]
    np.testing.assert_allclose(back, np.round(expected * 255) / 255, atol=1 / 255 + 1e-6)


@pytest.mark.parametrize("img, match", [
    (np.zeros((2, 3, 4)), r"cannot save .*x\.png: expected a \(H, W\) grey image; got shape \(2, 3, 4\)"),
    (np.zeros((0, 4)), r"expected a \(H, W\) grey image; got shape \(0, 4\)"),
    (np.full((3, 3), np.nan), r"cannot save .*x\.png: the image holds NaN or infinite values"),
])
def test_save_image_refuses_what_it_cannot_write(tmp_path, img, match):
    with pytest.raises(ImageDataError, match=match):
        save_image(img, tmp_path / "x.png")


def test_images_too_small_for_the_model_name_file_and_size(tmp_path):
    Image.fromarray(np.zeros((1, 7), np.uint8)).save(tmp_path / "thin.png")
    with pytest.raises(ImageDataError, match=r"image .*thin\.png is 7x1 \(width x height\), smaller than the 8x8 "
                                             r"smallest test image; remove it"):
        load_folder(tmp_path, min_size=8, reason="smallest test image; remove it")
    with pytest.raises(ImageDataError, match=r"thin\.png is 7x1 .*smaller than the 40x40 patch size; remove it or lower data\.patch_size"):
        load_folder(tmp_path, min_size=40)
    images, names = load_folder(tmp_path)  # any size works for a fully convolutional model
    assert images[0].shape == (1, 7) and names == ["thin.png"]
    with pytest.raises(ImageDataError, match=r"a\.png is 1x1"):
        check_image_size(np.zeros((1, 1), np.float32), "a.png", 2)
