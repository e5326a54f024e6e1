"""utils.images: one image reader for every task (bit depths, oversized files, hidden files, folders)."""
from __future__ import annotations

import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image

from learn2stop.utils.images import ImageReadError, list_image_files, read_image, to_uint8


def _png_header_only(path, w, h):
    """A PNG whose header claims w x h pixels, with almost no data: a decompression bomb in 100 bytes."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def test_8_and_16_bit_grey_read_alike(tmp_path):
    ramp8 = np.tile(np.arange(0, 256, 16, dtype=np.uint8), (5, 1))  # (5, 16)
    Image.fromarray(ramp8).save(tmp_path / "a8.png")
    Image.fromarray(ramp8.astype(np.uint16) * 257).save(tmp_path / "a16.png")  # the same image, 16 bits deep
    a8, notes8 = read_image(tmp_path / "a8.png", channels=1)
    a16, notes16 = read_image(tmp_path / "a16.png", channels=1)
    assert a8.shape == a16.shape == (1, 5, 16) and a8.dtype == np.float32
    np.testing.assert_allclose(a16, a8, atol=1e-6)  # scaled by 65535, not clipped at 255
    assert notes8 == notes16 == []
    rgb, notes = read_image(tmp_path / "a16.png", channels=3)
    assert rgb.shape == (3, 5, 16) and "converted to RGB" in notes[0]
    assert (to_uint8(rgb) == ramp8[None]).all()


def test_float_tiff_in_unit_range_kept_and_above_rescaled_with_a_note(tmp_path):
    rng = np.random.default_rng(0)
    unit = rng.random((6, 7)).astype(np.float32)
    Image.fromarray(unit, mode="F").save(tmp_path / "u.tif")
    Image.fromarray(unit * 1000, mode="F").save(tmp_path / "big.tif")
    Image.fromarray(unit - 0.5, mode="F").save(tmp_path / "neg.tif")
    a, notes = read_image(tmp_path / "u.tif", channels=1)
    np.testing.assert_allclose(a[0], unit) and not notes
    b, notes = read_image(tmp_path / "big.tif", channels=1)
    np.testing.assert_allclose(b[0], unit / unit.max(), rtol=1e-5)
    assert "big.tif" in notes[0] and "rescaled" in notes[0]
    with pytest.raises(ImageReadError, match=r"neg\.tif: a float image with negative values"):
        read_image(tmp_path / "neg.tif", channels=1)


def test_decompression_bomb_refused_from_the_header(tmp_path):
    _png_header_only(tmp_path / "bomb.png", 20000, 20000)
    with pytest.raises(ImageReadError, match=r"bomb\.png is too large to decode safely.*crop or shrink it first"):
        read_image(tmp_path / "bomb.png")
    _png_header_only(tmp_path / "big.png", 12000, 10000)  # under Pillow's own limit, over ours
    with pytest.raises(ImageReadError, match=r"big\.png is 12000x10000 \(120 Mpixels\), more than the 100 Mpixel"):
        read_image(tmp_path / "big.png")
    _png_header_only(tmp_path / "small.png", 50, 40)  # a sane size, but truncated data: named, not a traceback
    with pytest.raises(ImageReadError, match=r"cannot read image .*small\.png: not an image, truncated or corrupt"):
        read_image(tmp_path / "small.png")


def test_size_resize_and_custom_error(tmp_path):
    Image.fromarray(np.zeros((10, 12, 3), np.uint8)).save(tmp_path / "c.png")
    img, notes = read_image(tmp_path / "c.png", channels=1, size=8, resample="lanczos")
    assert img.shape == (1, 8, 8) and any("colour image (mode RGB) converted to greyscale" in n for n in notes)
    assert any("resized from 12x10 to 8x8" in n for n in notes)

    class MyError(ValueError):
        pass

    with pytest.raises(MyError, match=r"c\.png is 12x10, not 8x8 \(resizing is off\)"):
        read_image(tmp_path / "c.png", size=8, resize=False, error=MyError)
    with pytest.raises(MyError, match=r"image not found: .*missing\.png"):
        read_image(tmp_path / "missing.png", error=MyError)


def test_folder_listing_skips_hidden_files_and_names_an_empty_folder(tmp_path):
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(tmp_path / "b.png")
    (tmp_path / "sub").mkdir()
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(tmp_path / "sub" / "a.PNG")
    (tmp_path / ".DS_Store").write_bytes(b"\0\1junk")
    (tmp_path / "._b.png").write_bytes(b"\0\5resource fork")  # macOS metadata with an image suffix
    (tmp_path / "notes.txt").write_text("x")
    assert [p.name for p in list_image_files(tmp_path)] == ["b.png"]
    assert [p.name for p in list_image_files(tmp_path, recursive=True)] == ["b.png", "a.PNG"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImageReadError, match=r"no images \(.*\) in folder .*empty; it is empty"):
        list_image_files(tmp_path / "empty")
    with pytest.raises(ImageReadError, match=r"expected a folder of images, got a file: .*b\.png"):
        list_image_files(tmp_path / "b.png")


def test_every_task_reads_a_16_bit_png_the_same_way(tmp_path):
    from learn2stop.tasks.classify.data import ImageDataError, load_image_file
    from learn2stop.tasks.denoise.images import load_image
    from learn2stop.tasks.maml.omniglot import _load_gray

    ramp = (np.linspace(0, 65535, 8 * 8).reshape(8, 8)).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / "r.png")
    expect = to_uint8(ramp / 65535.0)
    assert (load_image_file(tmp_path / "r.png", 8, in_channels=1)[0][0] == expect).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plain grey image: nothing to note
        np.testing.assert_allclose(load_image(tmp_path / "r.png"), ramp / 65535.0, atol=1e-6)
    assert (_load_gray(tmp_path / "r.png", 8) == expect).all()
    (tmp_path / "bad.png").write_bytes(b"not a png")
    with pytest.raises(ImageDataError, match=r"bad\.png"):  # the task's own error class
        load_image_file(tmp_path / "bad.png", 8)


def _with_orientation(arr, path, orientation, **save):
    """Save ``arr`` (stored rows as given) with an EXIF orientation tag (0x0112)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(arr).save(path, exif=exif, **save)


# what a viewer does to the stored (H, W) pixels for each EXIF orientation
UPRIGHT = {1: lambda a: a, 2: lambda a: a[:, ::-1], 3: lambda a: a[::-1, ::-1], 4: lambda a: a[::-1],
           5: lambda a: a.T, 6: lambda a: np.rot90(a, -1), 7: lambda a: a[::-1, ::-1].T, 8: lambda a: np.rot90(a, 1)}


@pytest.mark.parametrize("orientation", sorted(UPRIGHT))
def test_an_image_is_read_the_way_up_its_exif_orientation_says(tmp_path, orientation):
    """A phone photo stored sideways (10 wide, 30 tall) with orientation 6 is the 30x10 image a viewer shows; every
    orientation places each pixel where a viewer does, and says so in a note."""
    stored = (np.arange(30 * 10) % 251).astype(np.uint8).reshape(30, 10)  # (H, W) as stored, pixels told apart
    _with_orientation(stored, tmp_path / "p.png", orientation)
    img, notes = read_image(tmp_path / "p.png", channels=1)
    want = UPRIGHT[orientation](stored)
    assert img.shape == (1, *want.shape)
    assert (to_uint8(img[0]) == want).all()
    assert (any("EXIF orientation" in n for n in notes)) == (orientation != 1)


def test_a_sideways_jpeg_photo_reads_upright_in_the_tasks_readers(tmp_path):
    """``classify predict`` and ``denoise denoise`` read through utils.images: a JPEG stored 10x30 (W x H) with
    orientation 6 is read 30 wide and 10 tall, its stored top-left corner at the top right; resized (classify's
    square input) from the upright image."""
    from learn2stop.tasks.classify.data import load_image_file
    from learn2stop.tasks.denoise.images import load_image

    stored = np.zeros((30, 10, 3), np.uint8)
    stored[:5, :5] = 255  # a white block in the stored top-left corner
    _with_orientation(stored, tmp_path / "photo.jpg", 6, quality=95)
    grey = load_image(tmp_path / "photo.jpg")
    assert grey.shape == (10, 30)
    assert grey[:5, -5:].mean() > 0.9 and grey[:, :25].mean() < 0.05
    rgb, notes = load_image_file(tmp_path / "photo.jpg", 10, in_channels=3)
    assert rgb.shape == (3, 10, 10) and rgb[:, :3, -2:].mean() > 200 and rgb[:, :, :6].mean() < 10
    assert any("stored as 10x30, read as 30x10" in n for n in notes)
    assert any("resized from 30x10 to 10x10" in n for n in notes)


def test_a_16_bit_png_is_turned_upright_at_its_full_depth(tmp_path):
    ramp = (np.arange(6 * 4).reshape(6, 4) * 2000).astype(np.uint16)
    _with_orientation(ramp, tmp_path / "r16.png", 8)
    img, _ = read_image(tmp_path / "r16.png", channels=1)
    np.testing.assert_allclose(img[0], np.rot90(ramp, 1) / 65535.0, atol=1e-7)
