"""Classification data: every loader on a tiny stand-in in its exact on-disk layout, the restricted
unpickler, bad files and labels, augmentation, normalisation and splits."""
import io
import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from learn2stop.tasks.classify.data import (CIFAR10_CLASSES, Augment, ImageDataError, ImageSet, channel_stats,
                                            list_datasets, load_cifar_binary, load_cifar_python, load_cifar_subset_npz,
                                            load_dataset, load_image_file, load_image_folder, load_pickle,
                                            load_tiny_imagenet, normalize, split_validation)

from conftest import shared_data


RNG = np.random.default_rng(0)


def images(n, size=32, channels=3):
    return RNG.integers(0, 256, (n, channels, size, size), dtype=np.uint8)


def save(path, arr, fmt=None, mode=None):
    """Write an (H, W[, C]) uint8 array as an image file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr, mode=mode).save(path, fmt)
    return path


def rgb(h, w=None):
    return RNG.integers(0, 256, (h, w or h, 3), dtype=np.uint8)


# ----------------------------------------------------------------------------- CIFAR
def test_npz_subset_layout(tmp_path):
    x, y = images(5), np.array([0, 9, 3, 3, 1], dtype=np.uint8)
    np.savez(tmp_path / "cifar10_subset.npz", train_images=x, train_labels=y, test_images=x[:2], test_labels=y[:2])
    train, test = load_cifar_subset_npz(tmp_path)
    assert train.images.shape == (5, 3, 32, 32) and train.labels.dtype == np.int64 and len(test) == 2
    assert np.array_equal(train.images, x) and train.labels.tolist() == [0, 9, 3, 3, 1]
    assert train.classes == CIFAR10_CLASSES
    np.savez(tmp_path / "bad.npz", train_images=x, train_labels=y)
    with pytest.raises(ImageDataError, match=r"bad.npz: missing array 'test_images'"):
        load_cifar_subset_npz(tmp_path / "bad.npz")
    np.savez(tmp_path / "range.npz", train_images=x, train_labels=y + 5, test_images=x, test_labels=y)
    with pytest.raises(ImageDataError, match=r"range.npz \[train\]: label 14 .*outside \[0, 10\)"):
        load_cifar_subset_npz(tmp_path / "range.npz")


def write_cifar_bin(folder, name, x, labels):
    """Records of the label byte(s) then 3072 channel-major pixel bytes."""
    labels = np.asarray(labels, dtype=np.uint8).reshape(len(x), -1)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(np.concatenate([labels, x.reshape(len(x), -1)], axis=1).tobytes())


def test_cifar10_and_cifar100_binary(tmp_path):
    root = tmp_path / "cifar-10-batches-bin"
    xs = [images(2) for _ in range(6)]
    for i in range(5):
        write_cifar_bin(root, f"data_batch_{i + 1}.bin", xs[i], [i, 9 - i])
    write_cifar_bin(root, "test_batch.bin", xs[5], [7, 7])
    (root / "batches.meta.txt").write_text("\n".join(CIFAR10_CLASSES) + "\n\n")
    train, test = load_dataset("cifar10_bin", tmp_path)  # the parent folder works too
    assert train.images.shape == (10, 3, 32, 32) and test.labels.tolist() == [7, 7]
    assert np.array_equal(train.images, np.concatenate(xs[:5])) and train.labels.tolist()[:4] == [0, 9, 1, 8]
    assert train.classes == CIFAR10_CLASSES

    root100 = tmp_path / "cifar-100-binary"
    write_cifar_bin(root100, "train.bin", xs[0], [[3, 55], [19, 99]])  # coarse, fine
    write_cifar_bin(root100, "test.bin", xs[1], [[0, 4], [1, 0]])
    (root100 / "fine_label_names.txt").write_text("\n".join(f"c{i}" for i in range(100)))
    train, test = load_cifar_binary(root100, num_classes=100)
    assert train.labels.tolist() == [55, 99] and test.labels.tolist() == [4, 0] and train.classes[99] == "c99"
    assert np.array_equal(test.images, xs[1])


def test_truncated_binary_and_bad_labels(tmp_path):
    root = tmp_path / "cifar-10-batches-bin"
    for i in range(5):
        write_cifar_bin(root, f"data_batch_{i + 1}.bin", images(1), [1])
    write_cifar_bin(root, "test_batch.bin", images(1), [1])
    (root / "batches.meta.txt").write_text("\n".join(CIFAR10_CLASSES))
    data = (root / "data_batch_3.bin").read_bytes()
    (root / "data_batch_3.bin").write_bytes(data[:-100])
    with pytest.raises(ImageDataError, match=r"data_batch_3.bin is truncated"):
        load_cifar_binary(root)
    write_cifar_bin(root, "data_batch_3.bin", images(1), [12])
    with pytest.raises(ImageDataError, match=r"data_batch_3.bin: label 12 .*outside \[0, 10\)"):
        load_cifar_binary(root)


def write_pickle(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)  # as the official (python 2) files


def cifar_py_batch(x, labels, key=b"labels"):
    return {b"batch_label": b"training batch", key: labels, b"data": x.reshape(len(x), -1),
            b"filenames": [f"img_{i}.png".encode() for i in range(len(x))]}


def test_cifar10_and_cifar100_python(tmp_path):
    root = tmp_path / "cifar-10-batches-py"
    xs = [images(3) for _ in range(6)]
    for i in range(5):
        write_pickle(root / f"data_batch_{i + 1}", cifar_py_batch(xs[i], [i, i, 9]))
    plain = cifar_py_batch(xs[5], [2, 4, 6])
    plain[b"data"] = plain[b"data"].tolist()  # plain lists are accepted too
    write_pickle(root / "test_batch", plain)
    write_pickle(root / "batches.meta", {b"label_names": [c.encode() for c in CIFAR10_CLASSES], b"num_vis": 3072})
    train, test = load_cifar_python(tmp_path)
    assert train.images.shape == (15, 3, 32, 32) and np.array_equal(train.images, np.concatenate(xs[:5]))
    assert train.labels.tolist()[:6] == [0, 0, 9, 1, 1, 9] and test.labels.tolist() == [2, 4, 6]
    assert np.array_equal(test.images, xs[5]) and train.classes == CIFAR10_CLASSES

    root100 = tmp_path / "cifar-100-python"
    write_pickle(root100 / "train", cifar_py_batch(xs[0], [5, 99, 0], key=b"fine_labels") | {b"coarse_labels": [1, 2, 3]})
    write_pickle(root100 / "test", cifar_py_batch(xs[1], [1, 2, 3], key=b"fine_labels"))
    write_pickle(root100 / "meta", {b"fine_label_names": [f"f{i}".encode() for i in range(100)],
                                    b"coarse_label_names": [b"x"] * 20})
    train, test = load_dataset("cifar100_py", root100)
    assert train.labels.tolist() == [5, 99, 0] and train.classes[5] == "f5" and len(train.classes) == 100

    write_pickle(root100 / "test", cifar_py_batch(xs[1], [1, 100, 3], key=b"fine_labels"))
    with pytest.raises(ImageDataError, match=r"cifar-100-python/test \[fine_labels\]: label 100"):
        load_cifar_python(root100, num_classes=100)
    write_pickle(root100 / "test", {b"data": xs[1].reshape(3, -1)})
    with pytest.raises(ImageDataError, match=r"test: missing field 'fine_labels'"):
        load_cifar_python(root100, num_classes=100)


class RunsCode:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class Evaluates:
    def __reduce__(self):
        return eval, ("1 + 1",)


def test_restricted_unpickler_refuses_code_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    root = tmp_path / "cifar-10-batches-py"
    batch = cifar_py_batch(images(1), [0])
    batch[b"labels"] = RunsCode(f"touch {marker}")
    write_pickle(root / "data_batch_1", batch)
    write_pickle(root / "batches.meta", {b"label_names": [c.encode() for c in CIFAR10_CLASSES]})
    with pytest.raises(ImageDataError, match=r"data_batch_1: refused global (posix|os|nt)\.system"):
        load_cifar_python(root)
    assert not marker.exists()
    write_pickle(tmp_path / "evil", Evaluates())
    with pytest.raises(ImageDataError, match=r"evil: refused global (builtins|__builtin__)\.eval"):
        load_pickle(tmp_path / "evil")
    (tmp_path / "codec").write_bytes(b"\x80\x02c_codecs\nencode\nq\x00X\x01\x00\x00\x00aX\x06\x00\x00\x00base64\x86R.")
    with pytest.raises(ImageDataError, match=r"codec: refused global _codecs.encode with codec 'base64'"):
        load_pickle(tmp_path / "codec")
    (tmp_path / "short").write_bytes(pickle.dumps(cifar_py_batch(images(1), [0]), protocol=2)[:50])
    with pytest.raises(ImageDataError, match=r"cannot read .*short: truncated"):
        load_pickle(tmp_path / "short")
    # what numpy itself writes (protocols 2 to 5, numpy scalars) still loads
    for protocol in (2, 4, 5):
        (tmp_path / "ok").write_bytes(pickle.dumps({b"data": images(1), b"n": np.int64(3)}, protocol=protocol))
        assert load_pickle(tmp_path / "ok")[b"n"] == 3
    numpy1 = pickle.dumps({b"data": images(1)}, protocol=2).replace(b"numpy._core.", b"numpy.core.")
    assert b"numpy.core.multiarray\n_reconstruct" in numpy1  # the official files' global
    (tmp_path / "ok").write_bytes(numpy1)
    assert load_pickle(tmp_path / "ok")[b"data"].shape == (1, 3, 32, 32)


# ----------------------------------------------------------------------------- image files
def test_single_image_conversions_and_errors(tmp_path):
    grey = save(tmp_path / "grey.png", RNG.integers(0, 256, (8, 8), dtype=np.uint8), mode="L")
    arr, notes = load_image_file(grey, size=8)
    assert arr.shape == (3, 8, 8) and np.array_equal(arr[0], arr[2]) and notes == [f"{grey}: L image converted to RGB"]
    rgba = save(tmp_path / "rgba.png", RNG.integers(0, 256, (8, 8, 4), dtype=np.uint8), mode="RGBA")
    arr, notes = load_image_file(rgba, size=8)
    assert arr.shape == (3, 8, 8) and "RGBA image converted to RGB" in notes[0]
    big = save(tmp_path / "big.jpg", rgb(10, 12))
    arr, notes = load_image_file(big, size=8)
    assert arr.shape == (3, 8, 8) and "resized from 12x10 to 8x8" in notes[0]
    with pytest.raises(ImageDataError, match=r"big.jpg is 12x10, not 8x8 \(resizing is off\)"):
        load_image_file(big, size=8, resize=False)
    assert load_image_file(big, size=None, in_channels=1)[0].shape == (1, 10, 12)
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(ImageDataError, match=r"cannot read image .*text.png"):
        load_image_file(tmp_path / "text.png", 8)
    for fmt, name in (("PNG", "cut.png"), ("JPEG", "cut.jpg")):
        buf = io.BytesIO()
        Image.fromarray(rgb(64)).save(buf, fmt)
        (tmp_path / name).write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
        with pytest.raises(ImageDataError, match=rf"{name}: not an image, truncated or corrupt"):
            load_image_file(tmp_path / name, 64)
    with pytest.raises(ImageDataError, match="image not found"):
        load_image_file(tmp_path / "missing.png", 8)


def test_class_folder_tree(tmp_path):
    root = tmp_path / "tree"
    for cls, n in (("zebra", 2), ("ant", 3), ("cat", 1)):
        for i in range(n):
            save(root / cls / f"{i}.png", rgb(6))
    (root / "ant" / "readme.txt").write_text("ignored")
    save(root / "cat" / "alpha.png", RNG.integers(0, 256, (6, 6, 4), dtype=np.uint8), mode="RGBA")
    with pytest.warns(UserWarning, match=r"1 image\(s\) converted: .*alpha.png: RGBA image converted to RGB"):
        data = load_image_folder(root)
    assert data.classes == ["ant", "cat", "zebra"] and data.images.shape == (7, 3, 6, 6)
    assert data.labels.tolist() == [0, 0, 0, 1, 1, 2, 2] and len(data.notes) == 1

    save(root / "cat" / "other.png", rgb(7))
    with pytest.raises(ImageDataError, match=r"other.png is 7x7 but .*0.png is 6x6"):
        load_image_folder(root)
    with pytest.warns(UserWarning, match="resized from 7x7 to 6x6"):
        assert load_image_folder(root, size=6).images.shape == (8, 3, 6, 6)
    with pytest.raises(ImageDataError, match=r"other.png is 7x7, not 6x6"):
        load_image_folder(root, size=6, resize=False)

    (root / "cat" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    with pytest.raises(ImageDataError, match=r"broken.png: not an image"):
        load_image_folder(root, size=6)

    one = tmp_path / "one"
    save(one / "only" / "a.png", rgb(4))
    with pytest.raises(ImageDataError, match=r"one holds 1 class folder\(s\) \(only\); .* at least 2"):
        load_image_folder(one)
    (tmp_path / "none").mkdir()
    with pytest.raises(ImageDataError, match=r"none holds 0 class folder\(s\) \(none\)"):
        load_image_folder(tmp_path / "none")
    (one / "empty").mkdir()
    with pytest.raises(ImageDataError, match=r"class folder .*empty has no images"):
        load_image_folder(one)


def test_folder_dataset_with_train_and_test_or_one_tree(tmp_path):
    for split, n in (("train", 4), ("test", 2)):
        for cls in ("b", "a"):
            for i in range(n):
                save(tmp_path / "ds" / split / cls / f"{i}.png", rgb(5))
    train, test = load_dataset("folder", tmp_path / "ds")
    assert train.classes == test.classes == ["a", "b"] and (len(train), len(test)) == (8, 4)
    save(tmp_path / "ds" / "test" / "c" / "0.png", rgb(5))
    with pytest.raises(ImageDataError, match=r"test: class folder\(s\) c are not among the training classes"):
        load_dataset("folder", tmp_path / "ds")
    train, test = load_dataset("folder", tmp_path / "ds" / "train", test_fraction=0.25, seed=3)
    assert (len(train), len(test)) == (6, 2) and sorted(test.labels.tolist()) == [0, 1]
    assert test.source.endswith("[test part]")
    with pytest.raises(KeyError, match="unknown dataset kind 'imagenet'; available: cifar100_bin"):
        load_dataset("imagenet", tmp_path)
    with pytest.raises(ValueError, match="unknown dataset option.*sizes"):
        load_dataset("folder", tmp_path / "ds", sizes=3)
    assert set(list_datasets()) == {"cifar_subset_npz", "cifar10_bin", "cifar100_bin", "cifar10_py", "cifar100_py",
                                    "tiny_imagenet", "folder"}


def test_tiny_imagenet_layout(tmp_path):
    root = tmp_path / "tiny-imagenet-200"
    wnids = ["n02", "n01"]
    (root / "wnids.txt").parent.mkdir(parents=True)
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    (root / "words.txt").write_text("n01\tgoldfish, Carassius auratus\nn02\tEuropean fire salamander\nn99\tother\n")
    for w in wnids:
        for i in range(2):
            save(root / "train" / w / "images" / f"{w}_{i}.JPEG", rgb(64), fmt="JPEG")
        (root / "train" / w / f"{w}_boxes.txt").write_text("")
    save(root / "train" / "n01" / "images" / "n01_9.JPEG", RNG.integers(0, 256, (64, 64), dtype=np.uint8),
         fmt="JPEG", mode="L")
    save(root / "val" / "images" / "val_0.JPEG", rgb(64), fmt="JPEG")
    save(root / "val" / "images" / "val_1.JPEG", rgb(48), fmt="JPEG")
    (root / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn01\t0\t0\t10\t10\nval_1.JPEG\tn02\t1\t2\t3\t4\n")
    with pytest.warns(UserWarning) as caught:
        train, test = load_dataset("tiny_imagenet", tmp_path)
    messages = " ".join(str(w.message) for w in caught)
    assert "n01_9.JPEG: L image converted to RGB" in messages and "val_1.JPEG: resized from 48x48 to 64x64" in messages
    assert train.classes == ["European fire salamander", "goldfish"]
    assert train.images.shape == (5, 3, 64, 64) and train.labels.tolist() == [0, 0, 1, 1, 1]
    assert test.images.shape == (2, 3, 64, 64) and test.labels.tolist() == [1, 0]
    with pytest.raises(ImageDataError, match=r"val_1.JPEG is 48x48, not 64x64"), pytest.warns(UserWarning):
        load_tiny_imagenet(root, resize=False)
    (root / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn07\t0\t0\t10\t10\n")
    with pytest.raises(ImageDataError, match=r"val_annotations.txt line 1: .*'val_0.JPEG\\tn07"), \
            pytest.warns(UserWarning):
        load_tiny_imagenet(root)


def test_image_set_checks():
    with pytest.raises(ImageDataError, match=r"mine: label -1 \(sample 1\) is outside \[0, 2\)"):
        ImageSet(images(2), np.array([0, -1]), ["a", "b"], "mine")
    with pytest.raises(ImageDataError, match="uint8"):
        ImageSet(images(2).astype(np.float32), np.array([0, 1]), ["a", "b"])
    with pytest.raises(ImageDataError, match="2 images but labels"):
        ImageSet(images(2), np.array([0]), ["a", "b"])


# ----------------------------------------------------------------------------- tensors and splits
def test_augment_crops_and_flips_reproducibly():
    x = torch.from_numpy(images(16, size=6))
    a = Augment(pad=2)
    out = a(x, torch.Generator().manual_seed(1))
    assert out.shape == x.shape and out.dtype == torch.uint8
    assert torch.equal(out, a(x, torch.Generator().manual_seed(1)))
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for img, pad in zip(out, padded):  # each output is a 6x6 window of the padded image, maybe flipped
        windows = [pad[:, i:i + 6, j:j + 6] for i in range(5) for j in range(5)]
        assert any(torch.equal(img, w) or torch.equal(img, w.flip(-1)) for w in windows)
    flips = Augment(pad=0)(x.float(), torch.Generator().manual_seed(0))
    flipped = [torch.equal(f, i.float().flip(-1)) for f, i in zip(flips, x)]
    assert all(f or torch.equal(o, i.float()) for f, o, i in zip(flipped, flips, x)) and 0 < sum(flipped) < 16
    assert torch.equal(Augment(pad=0, flip=False)(x, torch.Generator()), x)


def test_cutout_zeroes_one_clipped_square_per_image_after_the_plain_augmentation():
    x = torch.from_numpy(images(64, size=10)).clamp_min(1)  # no zero pixel but the holes'
    plain = Augment(pad=0)(x, torch.Generator().manual_seed(3))
    cut = Augment(pad=0, cutout=4)(x, torch.Generator().manual_seed(3))
    assert torch.equal(cut[(cut != 0)], plain[(cut != 0)])  # cutout draws last: the same crops and flips
    holes = (cut == 0) & (plain != 0)
    assert torch.equal(holes[:, :1].expand_as(holes), holes)  # every channel alike
    for h in holes[:, 0]:
        rows, cols = h.any(1).nonzero().flatten(), h.any(0).nonzero().flatten()
        assert h.sum() == len(rows) * len(cols) and 1 <= len(rows) <= 4 and 1 <= len(cols) <= 4  # a clipped square
        assert h[rows.min():rows.max() + 1, cols.min():cols.max() + 1].all()
    assert (holes.sum((1, 2, 3)) == 3 * 16).any() and (holes.sum((1, 2, 3)) < 3 * 16).any()  # whole and clipped
    with pytest.raises(ValueError, match="cutout must be >= 0"):
        Augment(cutout=-1)
    from learn2stop.tasks.classify.config import DataConfig
    from learn2stop.utils.config import ConfigError
    with pytest.raises(ConfigError, match=r"data\.cutout: must be in \[0, data\.size = 32\]"):
        DataConfig(size=32, cutout=40)


def test_channel_stats_and_normalize():
    x = images(40, size=4)
    x[:, 1] //= 4  # a darker channel
    mean, std = channel_stats(x, chunk=7)
    ref = x.astype(np.float64) / 255
    np.testing.assert_allclose(mean, ref.mean(axis=(0, 2, 3)), atol=1e-9)
    np.testing.assert_allclose(std, ref.std(axis=(0, 2, 3)), atol=1e-9)
    z = normalize(torch.from_numpy(x), mean, std)
    assert z.dtype == torch.float32
    torch.testing.assert_close(z.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(z.std(dim=(0, 2, 3), unbiased=False), torch.ones(3), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="channels"):
        normalize(torch.from_numpy(x), mean[:2], std[:2])


def test_split_validation_is_seeded_stratified_and_disjoint():
    data = ImageSet(images(30, size=2), np.repeat([0, 1, 2], 10), ["a", "b", "c"], "set")
    train, val = split_validation(data, 0.2, seed=5)
    assert (len(train), len(val)) == (24, 6) and np.bincount(val.labels).tolist() == [2, 2, 2]
    rows = lambda s: {r.tobytes() for r in s.images}
    assert not rows(train) & rows(val) and rows(train) | rows(val) == rows(data)
    again = split_validation(data, 0.2, seed=5)[1]
    assert np.array_equal(again.images, val.images)
    assert not np.array_equal(split_validation(data, 0.2, seed=6)[1].images, val.images)
    with pytest.raises(ValueError, match="fraction"):
        split_validation(data, 1.0, seed=0)


@pytest.mark.data
def test_shared_cifar_subset_loads():
    train, test = load_dataset("cifar_subset_npz", shared_data("cifar10-subset"))
    assert train.images.shape == (4068, 3, 32, 32) and test.images.shape == (1017, 3, 32, 32)
    assert set(np.unique(train.labels)) == set(range(10)) and train.classes[0] == "airplane"
    mean, _ = channel_stats(train.images)
    assert all(0.4 < m < 0.55 for m in mean)  # CIFAR-10's channel means are about 0.49, 0.48, 0.45


def test_a_one_class_dataset_is_refused(tmp_path):
    from learn2stop.tasks.classify.data import ImageDataError, load_dataset

    np.savez(tmp_path / "cifar10_subset.npz", train_images=np.zeros((6, 3, 32, 32), np.uint8),
             train_labels=np.zeros(6, np.int64), test_images=np.zeros((2, 3, 32, 32), np.uint8),
             test_labels=np.zeros(2, np.int64))
    with pytest.raises(ImageDataError, match=r"the training images hold 1 class\(es\) \(airplane\); a classifier needs"):
        load_dataset("cifar_subset_npz", tmp_path)
