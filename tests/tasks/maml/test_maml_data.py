"""Few-shot data: sampler guarantees, loaders on small generated data in each layout, bad inputs."""
import csv

import numpy as np
import pytest
import torch
from PIL import Image

from learn2stop.tasks.maml.classes import ClassImages, DataError, RotatedClasses
from learn2stop.tasks.maml.data import MiniImagenet
from learn2stop.tasks.maml.omniglot import load_omniglot_folders, load_omniglot_npz
from learn2stop.tasks.maml.samplers import FewShotSampler, SinusoidSampler

from conftest import shared_data


def coded_dataset(n_classes=9, per_class=7, side=6):
    """Image (c, i) has pixel [0, 0] = c and pixel [0, 1] = i, so a batch can be decoded exactly."""
    a = np.zeros((n_classes, per_class, side, side), dtype=np.uint8)
    for c in range(n_classes):
        for i in range(per_class):
            a[c, i, 0, 0], a[c, i, 0, 1] = c, i
    return ClassImages(a, [f"c{c}" for c in range(n_classes)])


def decode(x):
    v = torch.round(x[..., 0, 0, :2] * 255).long()  # (..., 2): class id, image index
    return v[..., 0], v[..., 1]


# ----------------------------------------------------------------------------- samplers
def test_sampler_guarantees():
    ds = coded_dataset()
    n, k1, k2, q = 4, 2, 5, 2
    sampler = FewShotSampler(n, k1, k2, q)
    sampler.check(ds)
    g = torch.Generator().manual_seed(0)
    seen_k = []
    for _ in range(10):
        inputs, target = sampler.batch(ds, 6, g)
        assert inputs["support_x"].shape == (6, n * k2, 1, 6, 6) and inputs["query_x"].shape == (6, n * q, 1, 6, 6)
        for b in range(6):
            k = int(inputs["shots"][b])
            seen_k.append(k)
            assert k1 <= k <= k2
            mask = inputs["support_mask"][b].bool()
            assert int(mask.sum()) == n * k and bool(mask[: n * k].all())
            sc, si = decode(inputs["support_x"][b][mask])
            qc, qi = decode(inputs["query_x"][b])
            sy, qy = inputs["support_y"][b][mask], target[b]
            classes = sc.view(n, k)[:, 0]
            assert len(set(classes.tolist())) == n  # classes distinct
            assert (sc.view(n, k) == classes[:, None]).all()  # every class gets the same K
            assert torch.equal(sy, torch.arange(n).repeat_interleave(k))
            assert torch.equal(qc, classes[qy])  # query label i is the task's i-th class
            for c in classes.tolist():
                s_idx, q_idx = set(si[sc == c].tolist()), set(qi[qc == c].tolist())
                assert len(s_idx) == k and len(q_idx) == q and not s_idx & q_idx  # no support/query overlap
    assert set(seen_k) == set(range(k1, k2 + 1))  # every K in the range occurs


def test_vanilla_sampler_has_fixed_shots():
    inputs, _ = FewShotSampler(3, 4, 4, 1).batch(coded_dataset(), 8, torch.Generator().manual_seed(0))
    assert (inputs["shots"] == 4).all() and bool(inputs["support_mask"].bool().all())


def test_sinusoid_sampler():
    inputs, target = SinusoidSampler(2, 6, 7).batch(None, 50, torch.Generator().manual_seed(0))
    assert inputs["support_x"].shape == (50, 6, 1) and target.shape == (50, 7, 1)
    assert inputs["shots"].min() >= 2 and inputs["shots"].max() <= 6
    assert torch.equal(inputs["support_mask"].sum(1).long(), inputs["shots"])
    assert inputs["support_x"].abs().max() <= 5 and target.abs().max() <= 5


def test_sampler_is_reproducible_from_the_generator():
    ds = coded_dataset()
    a = FewShotSampler(3, 1, 4, 2).batch(ds, 5, torch.Generator().manual_seed(3))
    b = FewShotSampler(3, 1, 4, 2).batch(ds, 5, torch.Generator().manual_seed(3))
    assert all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("k1, k2, match", [(3, 2, "k1 = 3 > k2 = 2"), (0, 2, "k1 = 0 < 1")])
def test_invalid_shot_ranges(k1, k2, match):
    with pytest.raises(DataError, match=match):
        FewShotSampler(5, k1, k2, 1)
    with pytest.raises(DataError, match=match):
        SinusoidSampler(k1, k2, 5)


def test_too_few_classes_or_images():
    ds = coded_dataset(n_classes=3, per_class=5)
    with pytest.raises(DataError, match="3 classes, fewer than n_way = 4"):
        FewShotSampler(4, 1, 2, 1).check(ds)
    with pytest.raises(DataError, match=r"class 'c0' has 5 images, fewer than k2 \+ query = 4 \+ 2 = 6"):
        FewShotSampler(2, 1, 4, 2).check(ds)


def test_rotated_classes():
    ds = coded_dataset(n_classes=2, per_class=3)
    rot = RotatedClasses(ds)
    assert rot.num_classes == 8 and rot.class_sizes == [3] * 8
    idx = torch.tensor([0, 2])
    for k in range(4):
        torch.testing.assert_close(rot.images(4 + k, idx), torch.rot90(ds.images(1, idx), k, dims=(-2, -1)))


# ----------------------------------------------------------------------------- Omniglot .npz
def write_npz_omniglot(root, n_bg=6, n_ev=4, drawings=5):
    root.mkdir(parents=True, exist_ok=True)
    names = []
    for part, n, offset in (("background", n_bg, 0), ("evaluation", n_ev, n_bg)):
        imgs = np.full((n, drawings, 28, 28), 255, dtype=np.uint8)
        for c in range(n):
            imgs[c, :, 0, 0] = 255 - (offset + c)  # after inversion pixel [0,0] = (offset + c) / 255
        alph = np.array([f"Alpha{(offset + c) % 3}" for c in range(n)])
        char = np.array([f"character{offset + c:02d}" for c in range(n)])
        np.savez_compressed(root / f"{part}.npz", images=imgs, char_id=np.arange(n, dtype=np.int16), alphabet=alph,
                            character=char)
        names += [f"{a}/{c}" for a, c in zip(alph, char)]
    return names


def test_omniglot_npz_follows_split_file(tmp_path):
    names = write_npz_omniglot(tmp_path / "omni")
    order = names[::-1]
    (tmp_path / "omni" / "maml_split.txt").write_text("\n".join(order) + "\n")
    parts = {s: load_omniglot_npz(tmp_path / "omni", s) for s in ("train", "val", "test")}
    assert [p.num_classes for p in parts.values()] == [7, 1, 2]  # 1100/100/423 scaled to 10 characters
    assert parts["train"].names + parts["val"].names + parts["test"].names == order
    x = parts["train"].images(0, torch.tensor([0, 1]))  # first split entry = last generated character (9)
    assert x.shape == (2, 1, 28, 28)
    assert round(float(x[0, 0, 0, 0]) * 255) == 9 and float(x[0, 0, 5, 5]) == 0.0  # inverted: background 0


def test_omniglot_npz_bad_inputs(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_omniglot_npz(tmp_path / "nope", "train")
    write_npz_omniglot(tmp_path / "omni")
    (tmp_path / "omni" / "evaluation.npz").unlink()
    with pytest.raises(DataError, match="evaluation.npz is missing"):
        load_omniglot_npz(tmp_path / "omni", "train")
    (tmp_path / "omni" / "evaluation.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="evaluation.npz is corrupt"):
        load_omniglot_npz(tmp_path / "omni", "train")
    write_npz_omniglot(tmp_path / "omni2")
    (tmp_path / "omni2" / "maml_split.txt").write_text("Nowhere/character99\n")
    with pytest.raises(DataError, match="Nowhere/character99"):
        load_omniglot_npz(tmp_path / "omni2", "train")


def test_omniglot_npz_real_split():
    root = shared_data("omniglot")
    train, val, test = (load_omniglot_npz(root, s) for s in ("train", "val", "test"))
    assert (train.num_classes, val.num_classes, test.num_classes) == (1100, 100, 423)
    assert train.names[0] == "Malayalam/character44"
    x = train.images(0, torch.arange(20))
    assert x.shape == (20, 1, 28, 28) and 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert float(x.mean()) < 0.5  # inverted: mostly background = 0, ink = 1
    FewShotSampler(20, 1, 5, 1).check(RotatedClasses(test))


# ----------------------------------------------------------------------------- Omniglot PNG folders
def write_png_omniglot(root, drawings=4):
    names = []
    for part, alphabets in (("images_background", ["Alpha", "Beta"]), ("images_evaluation", ["Gamma"])):
        for a in alphabets:
            for c in range(2):
                d = root / part / a / f"character{c + 1:02d}"
                d.mkdir(parents=True)
                for i in range(drawings):
                    img = np.ones((105, 105), dtype=bool)
                    img[10 + 10 * c: 40 + 10 * c, 20:30 + 5 * i] = False  # ink
                    Image.fromarray(img).save(d / f"{a[:2]}{c}_{i + 1:02d}.png")
                names.append(f"{a}/character{c + 1:02d}")
    return names


def test_omniglot_folders_load(tmp_path):
    names = write_png_omniglot(tmp_path)
    parts = [load_omniglot_folders(tmp_path, s) for s in ("train", "val", "test")]
    assert sorted(n for p in parts for n in p.names) == sorted(names)
    x = parts[0].images(0, torch.arange(4))
    assert x.shape == (4, 1, 28, 28) and float(x.max()) > 0.9 and float(x[:, :, 0, 0].max()) == 0.0
    (tmp_path / "maml_split.txt").write_text("\n".join(names) + "\n")
    assert load_omniglot_folders(tmp_path, "train").names == names[:4]


def test_omniglot_folders_bad_inputs(tmp_path):
    write_png_omniglot(tmp_path / "a")
    bad = tmp_path / "a" / "images_evaluation" / "Gamma" / "character01" / "Ga0_02.png"
    bad.write_bytes(b"\x89PNG garbage")
    with pytest.raises(DataError, match="cannot read image .*Ga0_02.png: not an image, truncated or corrupt"):
        load_omniglot_folders(tmp_path / "a", "train")
    write_png_omniglot(tmp_path / "b")
    for f in (tmp_path / "b" / "images_evaluation").rglob("*.png"):
        f.unlink()
    with pytest.raises(DataError, match="holds no .png files"):
        load_omniglot_folders(tmp_path / "b", "train")
    (tmp_path / "c" / "images_background").mkdir(parents=True)
    with pytest.raises(DataError, match="images_evaluation/ is missing"):
        load_omniglot_folders(tmp_path / "c", "train")


# ----------------------------------------------------------------------------- MiniImagenet
def write_mini(root, classes=(("n01", "n02", "n03"), ("n04", "n05"), ("n06", "n07")), per_class=4, size=20):
    (root / "images").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, cls in zip(("train", "val", "test"), classes):
        with open(root / f"{split}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["filename", "label"])
            for c in cls:
                for i in range(per_class):
                    name = f"{c}{i:08d}.jpg"
                    Image.fromarray(rng.integers(0, 255, (size, size + 3, 3), dtype=np.uint8)).save(root / "images" / name)
                    w.writerow([name, c])


def test_miniimagenet_loader(tmp_path):
    write_mini(tmp_path)
    train = MiniImagenet(tmp_path, "train", image_size=84)
    assert train.names == ["n01", "n02", "n03"] and train.class_sizes == [4, 4, 4]
    x = train.images(1, torch.tensor([0, 3]))
    assert x.shape == (2, 3, 84, 84) and 0 <= float(x.min()) and float(x.max()) <= 1
    inputs, target = FewShotSampler(2, 1, 2, 2).batch(MiniImagenet(tmp_path, "test", 84), 2, torch.Generator().manual_seed(0))
    assert inputs["query_x"].shape == (2, 4, 3, 84, 84)
    with pytest.raises(DataError, match="fewer than n_way = 3"):
        FewShotSampler(3, 1, 2, 1).check(MiniImagenet(tmp_path, "val"))


def test_miniimagenet_bad_inputs(tmp_path):
    with pytest.raises(DataError, match="not found"):
        MiniImagenet(tmp_path / "none", "train")
    write_mini(tmp_path / "m")
    (tmp_path / "m" / "val.csv").unlink()
    with pytest.raises(DataError, match="val.csv is missing"):
        MiniImagenet(tmp_path / "m", "val")
    (tmp_path / "m" / "images" / "n0100000002.jpg").write_bytes(b"garbage")
    ds = MiniImagenet(tmp_path / "m", "train")
    with pytest.raises(DataError, match="cannot read image .*n0100000002.jpg: not an image, truncated or corrupt"):
        ds.images(0, torch.tensor([1, 2]))
    (tmp_path / "m" / "images" / "n0100000001.jpg").unlink()
    with pytest.raises(DataError, match="n0100000001.jpg does not exist"):
        MiniImagenet(tmp_path / "m", "train")
    (tmp_path / "m" / "test.csv").write_text("file,class\nx.jpg,n1\n")
    with pytest.raises(DataError, match="header 'filename,label'"):
        MiniImagenet(tmp_path / "m", "test")
    (tmp_path / "n").mkdir()
    with pytest.raises(DataError, match="images/ is missing"):
        MiniImagenet(tmp_path / "n", "train")


# ----------------------------------------------------------------------------- MiniImagenet
def write_mini_rows(root, rows_by_split, size=8):
    """A MiniImagenet folder of the given (file name, label) rows per split, one blank image per file name."""
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
    root = write_mini_rows(tmp_path / "m", {**GOOD_MINI, **change})
    with pytest.raises(DataError, match=match):
        MiniImagenet(root, split, image_size=8)


def test_good_miniimagenet_has_one_image_shape(tmp_path):
    ds = MiniImagenet(write_mini_rows(tmp_path / "m", GOOD_MINI), "train", image_size=12)
    assert ds.image_shape == (3, 12, 12) and ds.images(0, torch.tensor([0, 1])).shape == (2, 3, 12, 12)
