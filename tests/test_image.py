"""jaxfeed.image: decoding against TensorFlow's, crop geometry, augmentations."""

import collections
import io
import os
import time

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # pylint: disable=g-import-not-at-top
from PIL import Image  # pylint: disable=g-import-not-at-top

from jaxfeed import image as jim  # pylint: disable=g-import-not-at-top
from gil_testing import spinner_count_during  # pylint: disable=g-import-not-at-top


def _photo(height=96, width=128, seed=0) -> np.ndarray:
  """A smooth color image with some texture (JPEG-friendly, not constant)."""
  y, x = np.mgrid[0:height, 0:width]
  rng = np.random.default_rng(seed)
  noise = rng.integers(0, 40, (height, width, 3))
  rgb = np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], -1)
  return np.clip(rgb + noise, 0, 255).astype(np.uint8)


def _encode(array, fmt="JPEG", **kw) -> bytes:
  buffer = io.BytesIO()
  Image.fromarray(array).save(buffer, fmt, **kw)
  return buffer.getvalue()


@pytest.mark.parametrize("quality,subsampling", [(90, 0), (75, 2)])
def test_decode_jpeg_matches_tensorflow(quality, subsampling):
  data = _encode(_photo(), quality=quality, subsampling=subsampling)
  ours = jim.decode_jpeg(data)
  # Both are libjpeg-turbo: with the same (accurate integer) IDCT, the same
  # pixels. TensorFlow's default, the fast IDCT, is a few steps off.
  theirs = tf.io.decode_jpeg(data, channels=3, dct_method="INTEGER_ACCURATE").numpy()
  assert ours.dtype == np.uint8 and ours.shape == (96, 128, 3)
  np.testing.assert_array_equal(ours, theirs)
  fast = tf.io.decode_jpeg(data, channels=3).numpy()
  assert np.abs(ours.astype(int) - fast).max() <= 8


def test_decode_jpeg_gray_and_file_channels():
  gray = _photo()[:, :, 0]
  data = _encode(gray, quality=95)
  assert jim.decode_jpeg(data, channels=0).shape == (96, 128, 1)
  np.testing.assert_array_equal(
    jim.decode_jpeg(data, channels=1),
    tf.io.decode_jpeg(data, channels=1, dct_method="INTEGER_ACCURATE").numpy(),
  )
  assert jim.decode_jpeg(data).shape == (96, 128, 3)


def test_decode_image_png_is_exact():
  photo = _photo(40, 50)
  np.testing.assert_array_equal(jim.decode_image(_encode(photo, "PNG")), photo)
  rgba = np.dstack([photo, np.full((40, 50), 7, np.uint8)])
  data = _encode(rgba, "PNG")
  np.testing.assert_array_equal(jim.decode_image(data, channels=0), rgba)
  np.testing.assert_array_equal(jim.decode_image(data, channels=0), tf.io.decode_png(data).numpy())


def test_bad_bytes_are_refused_clearly():
  with pytest.raises(ValueError, match="neither JPEG nor PNG"):
    jim.decode_image(b"GIF89a....")
  truncated = _encode(_photo())[:300]
  with pytest.raises(ValueError, match="300-byte JPEG cannot be decoded"):
    jim.decode_jpeg(truncated)
  with pytest.raises(ValueError, match="a PNG, not a JPEG"):
    jim.decode_jpeg(_encode(_photo(), "PNG"))
  with pytest.raises(ValueError, match="channels must be one of"):
    jim.decode_jpeg(_encode(_photo()), channels=2)


def test_crop_boxes_lie_inside_and_follow_scale_and_ratio():
  rng = np.random.default_rng(0)
  areas, ratios = [], []
  for _ in range(2000):
    top, left, h, w = jim.random_crop_box(300, 400, rng, (0.2, 0.9), (0.5, 2.0))
    assert 0 <= top and top + h <= 300 and 0 <= left and left + w <= 400
    areas.append(h * w / (300 * 400))
    ratios.append(w / h)
  areas, ratios = np.array(areas), np.array(ratios)
  assert areas.min() >= 0.19 and areas.max() <= 0.91
  assert ratios.min() >= 0.49 and ratios.max() <= 2.02
  # Spread over the range, not stuck at the fallback.
  assert areas.std() > 0.15 and np.log(ratios).std() > 0.3


def test_crop_box_falls_back_to_a_centered_crop():
  rng = np.random.default_rng(0)
  # A 10x1000 strip cannot hold a crop of ratio <= 4/3 and area >= 8%.
  top, left, h, w = jim.random_crop_box(10, 1000, rng)
  assert (top, h) == (0, 10) and w == 13 and left == (1000 - 13) // 2


def test_random_resized_crop_equals_crop_then_resize_of_full_decode():
  # Smooth, so that the smoothing of reduced-scale decoding hardly matters.
  y, x = np.mgrid[0:480, 0:640]
  smooth = np.stack([x * 255 // 640, y * 255 // 480, (x + y) * 255 // 1120], -1)
  data = _encode(smooth.astype(np.uint8), quality=95)
  full = jim.decode_jpeg(data)
  for seed in range(6):
    out = jim.decode_and_random_resized_crop(data, np.random.default_rng(seed), (32, 48))
    assert out.shape == (32, 48, 3) and out.dtype == np.uint8
    top, left, h, w = jim.random_crop_box(480, 640, np.random.default_rng(seed))
    want = tf.image.resize(full[top : top + h, left : left + w], (32, 48)).numpy()
    assert np.abs(out.astype(float) - want).mean() < 3


def test_random_resized_crop_decodes_small_crops_at_reduced_scale(monkeypatch):
  import simplejpeg  # pylint: disable=g-import-not-at-top

  sizes = []
  decode = simplejpeg.decode_jpeg

  def recording_decode(*args, **kwargs):
    out = decode(*args, **kwargs)
    sizes.append(out.shape[:2])
    return out

  monkeypatch.setattr(simplejpeg, "decode_jpeg", recording_decode)
  data = _encode(_photo(480, 640))
  jim.decode_and_random_resized_crop(
    data, np.random.default_rng(0), 16, scale=(0.5, 0.5), ratio=(1, 1)
  )
  jim.decode_and_random_resized_crop(
    data, np.random.default_rng(0), 300, scale=(0.5, 0.5), ratio=(1, 1)
  )
  assert sizes == [(60, 80), (480, 640)]


def test_png_random_resized_crop():
  out = jim.decode_and_random_resized_crop(
    _encode(_photo(), "PNG"), np.random.default_rng(1), 20, channels=1
  )
  assert out.shape == (20, 20, 1)


def test_normalize_of_a_batch_and_of_gray_images():
  batch = np.stack([_photo(4, 5), _photo(4, 5, seed=1)])
  np.testing.assert_allclose(
    jim.normalize(batch, mean=(1, 2, 3), std=(2, 4, 8)),
    (batch - np.array([1, 2, 3])) / np.array([2, 4, 8]),
    rtol=1e-6,
  )
  gray = _photo(4, 5)[:, :, :1]
  np.testing.assert_allclose(jim.normalize(gray, 10.0, 5.0), (gray - 10.0) / 5.0, rtol=1e-6)
  with pytest.raises(ValueError, match="need 1 or 3 values"):
    jim.normalize(batch, mean=(1, 2))


def test_flips_and_normalize():
  image = _photo(4, 5)
  np.testing.assert_array_equal(jim.flip_left_right(image), image[:, ::-1])
  batch = np.stack([image, image])
  np.testing.assert_array_equal(jim.flip_left_right(batch), batch[:, :, ::-1])
  np.testing.assert_array_equal(jim.flip_left_right(image), tf.image.flip_left_right(image).numpy())
  flips = [
    jim.random_flip_left_right(image, np.random.default_rng(s)) is not image for s in range(40)
  ]
  assert 5 < sum(flips) < 35
  out = jim.normalize(image)
  assert out.dtype == np.float32
  np.testing.assert_allclose(
    out, (image - np.array(jim.IMAGENET_MEAN)) / np.array(jim.IMAGENET_STD), rtol=1e-5, atol=1e-5
  )
  with pytest.raises(ValueError, match="std must be non-zero"):
    jim.normalize(image, std=(1.0, 0.0, 1.0))


def test_decoding_and_resizing_release_the_gil_so_threads_overlap():
  data = _encode(_photo(960, 1280), quality=95)
  rng = np.random.default_rng(0)
  assert spinner_count_during(lambda: [jim.decode_jpeg(data) for _ in range(2)]) > 1000
  assert (
    spinner_count_during(
      lambda: [
        jim.decode_and_random_resized_crop(data, rng, 900, scale=(1.0, 1.0)) for _ in range(2)
      ]
    )
    > 1000
  )

  def hold_gil():  # the control: Python code never releases the GIL itself
    deadline = time.perf_counter() + 0.2
    while time.perf_counter() < deadline:
      pass

  assert spinner_count_during(hold_gil) < 100


@pytest.mark.parametrize("channels", [3, 1])
def test_out_arrays_receive_exactly_the_new_arrays_results(channels):
  data = _encode(_photo(120, 160))
  want = jim.decode_and_random_resized_crop(
    data, np.random.default_rng(3), (24, 32), channels=channels
  )
  slot = np.full((24, 32, channels), 7, np.uint8)
  got = jim.decode_and_random_resized_crop(
    data, np.random.default_rng(3), (24, 32), channels=channels, out=slot
  )
  assert got is slot
  np.testing.assert_array_equal(slot, want)
  flipped = np.empty_like(slot)
  assert jim.flip_left_right(slot, out=flipped) is flipped
  np.testing.assert_array_equal(flipped, jim.flip_left_right(want))
  for seed in range(4):  # both outcomes of the draw land in out
    draw = np.empty_like(slot)
    assert jim.random_flip_left_right(slot, np.random.default_rng(seed), out=draw) is draw
    np.testing.assert_array_equal(
      draw, jim.random_flip_left_right(want, np.random.default_rng(seed))
    )
  batch = np.zeros((2, 24, 32, channels), np.float32)
  assert jim.normalize(slot, 10.0, 5.0, out=batch[1]).base is batch
  np.testing.assert_array_equal(batch[1], jim.normalize(want, 10.0, 5.0))
  assert not batch[0].any()


def test_out_arrays_that_do_not_fit_are_refused():
  data = _encode(_photo())
  rng = np.random.default_rng(0)
  with pytest.raises(
    ValueError,
    match=r"out must be a writeable C-contiguous "
    r"uint8 array of shape \(8, 8, 3\), got a contiguous "
    r"float32 array of shape \(8, 8, 3\)",
  ):
    jim.decode_and_random_resized_crop(data, rng, 8, out=np.empty((8, 8, 3), np.float32))
  with pytest.raises(ValueError, match="got a non-contiguous uint8 array"):
    jim.decode_and_random_resized_crop(data, rng, 8, out=np.empty((8, 16, 3), np.uint8)[:, ::2])
  image = _photo(4, 5)
  with pytest.raises(ValueError, match="must not overlap"):
    jim.flip_left_right(image, out=image)
  with pytest.raises(
    ValueError,
    match=r"float32 array of shape \(4, 5, 3\), "
    r"got list",
  ):
    jim.normalize(image, out=[])


@pytest.mark.parametrize(
  "shape", [(48, 56, 3), (2, 48, 56, 3), (48, 56, 1), (48, 56, 4), (48, 56, 5)]
)
def test_normalize_of_uint8_gives_the_bits_of_float32_arithmetic(shape):
  # uint8 images are normalized through a table of the 256 results; they
  # must equal the float32 scale-and-shift bit for bit, in a new array and
  # in `out`, for every channel count (5 channels take the arithmetic).
  image = (np.arange(np.prod(shape)) % 256).astype(np.uint8).reshape(shape)
  np.random.default_rng(0).shuffle(image.reshape(-1))  # every value occurs
  channels = shape[-1]
  mean = np.linspace(0, 200, channels).astype(np.float32)
  std = np.linspace(3, 70, channels).astype(np.float32)
  inverse = np.float32(1) / std
  want = image.astype(np.float32) * inverse + (-mean * inverse)
  np.testing.assert_array_equal(jim.normalize(image, mean, std), want)
  out = np.full(shape, np.nan, np.float32)
  assert jim.normalize(image, mean, std, out=out) is out
  np.testing.assert_array_equal(out, want)
  # Not contiguous: normalized all the same.
  np.testing.assert_array_equal(jim.normalize(image[..., ::-1, :], mean, std), want[..., ::-1, :])


def _offset_of(crop: np.ndarray, image: np.ndarray) -> tuple:
  """Where `crop` sits in `image`, whose values are all different."""
  return tuple(int(i) for i in np.argwhere(image == crop.flat[0])[0])


@pytest.mark.parametrize(
  "shape,size",
  [
    ((5, 6, 3), (3, 4, 3)),
    ((5, 6, 3), (5, 6, 3)),
    ((5, 6, 3), (1, 1, 1)),
    ((7, 4), (2, 4)),
    ((2, 5, 6, 1), (2, 3, 2, 1)),
    ((4, 4, 3), (0, 2, 3)),
  ],
)
def test_random_crop_has_tensorflows_shapes_and_reaches_every_offset(shape, size):
  image = np.arange(np.prod(shape), dtype=np.int32).reshape(shape)
  rng = np.random.default_rng(0)
  ours = [jim.random_crop(image, size, rng) for _ in range(2000)]
  theirs = [tf.image.random_crop(image, size, seed=s).numpy() for s in range(60)]
  assert {c.shape for c in ours} == {t.shape for t in theirs} == {tuple(size)}
  if 0 in size:
    return
  limits = [n - c + 1 for n, c in zip(shape, size)]
  every_offset = set(np.ndindex(*limits))
  reached = {_offset_of(c, image) for c in ours}
  assert reached == every_offset
  # Each crop is the image's block at its offset, as TensorFlow's crops are.
  for crop in ours[:20] + theirs:
    offset = _offset_of(crop, image)
    assert offset in every_offset
    np.testing.assert_array_equal(crop, image[tuple(slice(o, o + c) for o, c in zip(offset, size))])


def test_random_crop_offsets_are_uniform_and_follow_the_generator():
  image = np.arange(4 * 3, dtype=np.int32).reshape(4, 3)
  counts = collections.Counter(
    _offset_of(jim.random_crop(image, (2, 2), np.random.default_rng(s)), image) for s in range(3000)
  )
  assert len(counts) == 6 and min(counts.values()) > 400  # 500 expected each
  first = jim.random_crop(image, (2, 2), np.random.default_rng(7))
  np.testing.assert_array_equal(first, jim.random_crop(image, (2, 2), np.random.default_rng(7)))
  assert np.shares_memory(first, image), "a view, as slicing gives"


@pytest.mark.parametrize(
  "size,message",
  [
    ((6, 4, 3), r"size \(6, 4, 3\) is larger than the image of shape \(5, 6, 3\)"),
    ((3, 7, 3), "is larger than the image"),
    ((3, 4, 4), "is larger than the image"),
    ((3, 4), r"size must be 3 non-negative ints .*shape \(5, 6, 3\).*got \(3, 4\)"),
    ((3, 4.5, 3), "size must be 3 non-negative ints"),
  ],
)
def test_random_crop_refuses_sizes_tensorflow_refuses(size, message):
  image = np.zeros((5, 6, 3), np.uint8)
  with pytest.raises(ValueError, match=message):
    jim.random_crop(image, size, np.random.default_rng(0))
  with pytest.raises((tf.errors.InvalidArgumentError, ValueError, TypeError)):
    tf.image.random_crop(image, size, seed=0)


def test_random_crop_refuses_a_negative_size():
  # TensorFlow crops (3, -1, 3) of a (5, 6, 3) image to (3, 1, 3) silently.
  with pytest.raises(ValueError, match="size must be 3 non-negative ints"):
    jim.random_crop(np.zeros((5, 6, 3)), (3, -1, 3), np.random.default_rng(0))


def test_random_crop_and_flip_in_a_random_map_pipeline():
  import jaxfeed  # pylint: disable=g-import-not-at-top

  images = np.random.default_rng(0).integers(0, 255, (16, 10, 12, 3), np.uint8)

  def augment(element, rng):
    crop = jim.random_crop(element["image"], (8, 8, 3), rng)
    return {"image": jim.random_flip_left_right(crop, rng)}

  dataset = (
    jaxfeed.Dataset.from_tensor_slices({"image": images}).random_map(augment, seed=3).batch(16)
  )
  first, second = next(iter(dataset)), next(iter(dataset))
  assert first["image"].shape == (16, 8, 8, 3)
  np.testing.assert_array_equal(first["image"], second["image"])
