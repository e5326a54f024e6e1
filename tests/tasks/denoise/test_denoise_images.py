"""Denoising image files: folders and bad images, the dead-leaves default, the shared data."""
import numpy as np
import pytest
import torch
from PIL import Image

from learn2stop.tasks.denoise import ImageDataError, PatchBank, load_image
from learn2stop.tasks.denoise.images import check_image_size, list_images, load_folder, save_image, synthetic_images

from conftest import shared_data


def write_png(path, arr, mode="L"):
    Image.fromarray(arr, mode=mode).save(path)
    return path


# ----------------------------------------------------------------------------- loading and bad inputs
def test_grey_png_round_trip(tmp_path):
    arr = (np.arange(35 * 21) % 256).astype(np.uint8).reshape(21, 35)
    img = load_image(write_png(tmp_path / "a.png", arr))
    assert img.shape == (21, 35) and img.dtype == np.float32
    np.testing.assert_allclose(img, arr / 255.0, atol=1e-6)


def test_colour_image_is_converted_with_a_warning(tmp_path):
    rgb = np.zeros((8, 9, 3), dtype=np.uint8)
    rgb[..., 0] = 255
    path = write_png(tmp_path / "c.png", rgb, mode="RGB")
    with pytest.warns(UserWarning, match="greyscale"):
        img = load_image(path)
    assert img.shape == (8, 9)
    np.testing.assert_allclose(img, round(0.299 * 255) / 255.0, atol=2 / 255)


def test_corrupt_missing_and_empty(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG not really")
    with pytest.raises(ImageDataError, match="cannot read image .*bad.png"):
        load_image(bad)
    with pytest.raises(ImageDataError, match="not found"):
        load_image(tmp_path / "nope.png")
    with pytest.raises(ImageDataError, match="not found"):
        list_images(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here")
    with pytest.raises(ImageDataError, match="no images"):
        list_images(empty)


def test_image_smaller_than_patch_is_a_clear_error(tmp_path):
    write_png(tmp_path / "small.png", np.zeros((10, 30), dtype=np.uint8))
    with pytest.raises(ImageDataError, match="smaller than the 20x20 patch"):
        load_folder(tmp_path, min_size=20)
    with pytest.raises(ImageDataError, match="smaller than the 20x20 patch"):
        PatchBank([np.zeros((10, 30), np.float32)], patch_size=20, stride=5)


def test_synthetic_images_are_deterministic_and_textured():
    a, b = synthetic_images(2, 48, seed=7), synthetic_images(2, 48, seed=7)
    assert np.array_equal(a[0], b[0]) and not np.array_equal(a[0], a[1])
    assert a[0].shape == (48, 48) and 0 <= a[0].min() and a[0].max() <= 1 and a[0].std() > 0.1


def test_shared_denoising_data_loads():
    root = shared_data("denoising")
    bsd = list_images(root / "BSD68")
    train = list_images(root / "Train400")
    assert len(bsd) == 68 and len(train) == 400
    img = load_image(bsd[0])
    assert sorted(img.shape) == [321, 481]
    assert load_image(train[0]).shape == (180, 180)


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
