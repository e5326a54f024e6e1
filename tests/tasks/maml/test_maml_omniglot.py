"""Omniglot on disk (tasks/maml/omniglot.py): .npz and PNG folders read, and misaligned, duplicated or blank names,
leaking splits, truncated files and odd image sizes refused by name."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from learn2stop.tasks.maml.classes import DataError
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


def test_truncated_omniglot_npz_and_image_size_are_named(tmp_path):
    from learn2stop.tasks.maml.classes import DataError
    from learn2stop.tasks.maml.config import DataConfig
    from learn2stop.tasks.maml.data import Data
    from learn2stop.tasks.maml.omniglot import load_omniglot_npz

    root = write_npz(tmp_path / "o", GOOD_BG, GOOD_EV)
    data = (root / "background.npz").read_bytes()
    (root / "background.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"background\.npz is corrupt, truncated or lacks the arrays"):
        load_omniglot_npz(root, "train")
    root = write_npz(tmp_path / "p", GOOD_BG, GOOD_EV)
    with pytest.raises(DataError, match=r"the \.npz images are 28x28, but data\.image_size is 32"):
        Data(DataConfig(source="omniglot_npz", path=str(root), n_way=2, image_size=32))
