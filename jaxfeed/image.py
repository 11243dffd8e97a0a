"""Image decoding and augmentation for input pipelines (JPEG, PNG).

Needs the optional `image` extra (`pip install jaxfeed[image]`): JPEG is
decoded by simplejpeg (libjpeg-turbo), PNG decoding, resizing, flipping and
the normalizing of uint8 images (a table lookup) are OpenCV's. Chosen by
measurement (CPU time per ~256 px image, one thread): simplejpeg decodes in
about 60% of OpenCV's time and half of Pillow's, with the same pixels;
OpenCV's bilinear resize to 224 x 224 takes about a sixth of Pillow's, its
flip a twentieth of NumPy's copy, and its table lookup half the time of
NumPy's cast, scale and shift. All of them release the GIL, so a `map` /
`random_map` with `num_parallel_calls` threads scales with cores.

A function that writes its output into a batch row (`writes_out=True` of
`map` / `random_map`) passes that row as `normalize`'s `out`, so the float32
image is written once, into the batch, with no copy and no fresh memory.

Images are uint8 arrays [height, width, channels]. `channels=3` (the default)
gives RGB, 1 gray, 0 what the file holds. JPEG pixels equal
`tf.io.decode_jpeg(..., dct_method="INTEGER_ACCURATE")` (TensorFlow's default,
the fast IDCT, differs by a few steps).

`decode_and_random_resized_crop` draws the crop of Inception-style training
(an area fraction in `scale`, an aspect ratio in `ratio`) before decoding, and
decodes JPEGs at the smallest DCT scale (1/8, 1/4, 1/2 or 1) that still gives
the crop at least `size` pixels, so a small output from a large image costs a
fraction of a full decode. Resizing is bilinear with half-pixel centers and
no antialiasing, like `tf.image.resize`'s default; the reduced-scale decode
keeps any shrink below 2x.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import numpy as np

__all__ = [
  "decode_jpeg",
  "decode_image",
  "decode_and_random_resized_crop",
  "random_crop_box",
  "random_crop",
  "flip_left_right",
  "random_flip_left_right",
  "normalize",
  "IMAGENET_MEAN",
  "IMAGENET_STD",
]

# Per-channel RGB mean and standard deviation of ImageNet, in 0..255 pixels.
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)

_JPEG_MAGIC = b"\xff\xd8\xff"
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_CROP_ATTEMPTS = 10
# OpenCV counts an array's rows and columns in 32-bit ints.
_LUT_MAX_SIZE = 1 << 31


def _modules():
  try:
    import cv2  # pylint: disable=g-import-not-at-top
    import simplejpeg  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
      f"jaxfeed.image needs the image extra ({e}): pip install "
      "'jaxfeed[image]' (simplejpeg and opencv-python-headless)."
    ) from None
  return simplejpeg, cv2


def _check_channels(channels: Any, where: str, allowed=(0, 1, 3)) -> int:
  if channels not in allowed or isinstance(channels, bool):
    raise ValueError(f"{where}: channels must be one of {allowed}, got {channels!r}.")
  return channels


def _format_of(data: bytes, where: str) -> str:
  if not isinstance(data, (bytes, bytearray, memoryview, np.ndarray)):
    raise TypeError(f"{where}: data must be bytes, got {type(data).__name__}.")
  head = bytes(data[:8])
  if head.startswith(_JPEG_MAGIC):
    return "jpeg"
  if head == _PNG_MAGIC:
    return "png"
  raise ValueError(
    f"{where}: the {len(data)} bytes are neither JPEG nor PNG (they start "
    f"with {head!r}); only JPEG and PNG are decoded."
  )


def _jpeg_colorspace(simplejpeg, data: bytes, channels: int) -> str:
  if channels == 0:
    _, _, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    return "GRAY" if colorspace == "Gray" else "RGB"
  return "GRAY" if channels == 1 else "RGB"


def _decode_jpeg(
  data: bytes, channels: int, where: str, min_size: tuple[int, int] | None = None
) -> np.ndarray:
  simplejpeg, _ = _modules()
  try:
    colorspace = _jpeg_colorspace(simplejpeg, data, channels)
    kwargs = {}
    if min_size is not None:
      kwargs = {"min_height": min_size[0], "min_width": min_size[1]}
    image = simplejpeg.decode_jpeg(data, colorspace=colorspace, **kwargs)
  except ValueError as e:
    raise ValueError(f"{where}: the {len(data)}-byte JPEG cannot be decoded: {e}") from None
  return image if image.ndim == 3 else image[:, :, None]


def _decode_png(data: bytes, channels: int, where: str) -> np.ndarray:
  _, cv2 = _modules()
  flag = {
    0: cv2.IMREAD_UNCHANGED,
    1: cv2.IMREAD_GRAYSCALE,
    3: cv2.IMREAD_COLOR_RGB,
    4: cv2.IMREAD_UNCHANGED,
  }[channels]
  image = cv2.imdecode(np.frombuffer(data, np.uint8), flag)
  if image is None:
    raise ValueError(f"{where}: the {len(data)}-byte PNG cannot be decoded.")
  if image.dtype == np.uint16:  # 16-bit PNGs are scaled to uint8
    image = ((image.astype(np.uint32) + 128) // 257).astype(np.uint8)
  if image.ndim == 2:
    image = image[:, :, None]
  if flag == cv2.IMREAD_UNCHANGED:  # OpenCV's channel order is BGR(A)
    if image.shape[2] == 3:
      image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
    elif image.shape[2] == 4:
      image = cv2.cvtColor(image, cv2.COLOR_BGRA2RGBA)
    if channels == 4 and image.shape[2] != 4:
      image = cv2.cvtColor(
        image if image.shape[2] == 3 else image[:, :, 0],
        cv2.COLOR_RGB2RGBA if image.shape[2] == 3 else cv2.COLOR_GRAY2RGBA,
      )
  return image


def decode_jpeg(data: bytes, channels: int = 3) -> np.ndarray:
  """Decodes a JPEG to uint8 [height, width, channels].

  Args:
    data: The JPEG file's bytes.
    channels: 3 for RGB, 1 for gray, 0 for what the file holds.

  Raises:
    ValueError: the bytes are not a JPEG that decodes.
  """
  where = "decode_jpeg"
  _check_channels(channels, where)
  if _format_of(data, where) != "jpeg":
    raise ValueError(f"{where}: the {len(data)} bytes are a PNG, not a JPEG; use decode_image.")
  return _decode_jpeg(data, channels, where)


def decode_image(data: bytes, channels: int = 3) -> np.ndarray:
  """Decodes a JPEG or PNG to uint8 [height, width, channels].

  Args:
    data: The file's bytes.
    channels: 3 for RGB, 1 for gray, 4 for RGBA (PNG), 0 for what the file
      holds.

  Raises:
    ValueError: the bytes are neither JPEG nor PNG, or do not decode.
  """
  where = "decode_image"
  if _format_of(data, where) == "jpeg":
    return _decode_jpeg(data, _check_channels(channels, where), where)
  return _decode_png(data, _check_channels(channels, where, (0, 1, 3, 4)), where)


def random_crop_box(
  height: int,
  width: int,
  rng: np.random.Generator,
  scale: Sequence[float] = (0.08, 1.0),
  ratio: Sequence[float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
  """A random crop (top, left, crop_height, crop_width) inside an image.

  The crop's area is a uniform fraction in `scale` of the image's and its
  aspect ratio (width / height) log-uniform in `ratio`; after 10 draws that do
  not fit, the largest centered crop with a ratio in `ratio`.

  Args:
    height: Image height.
    width: Image width.
    rng: The random generator.
    scale: (min, max) area fraction, 0 < min <= max <= 1.
    ratio: (min, max) aspect ratio, 0 < min <= max.
  """
  if not (0 < scale[0] <= scale[1] <= 1):
    raise ValueError(
      f"random_crop_box: scale must be (min, max) with 0 < min <= max <= 1, got {tuple(scale)}."
    )
  if not (0 < ratio[0] <= ratio[1]):
    raise ValueError(
      f"random_crop_box: ratio must be (min, max) with 0 < min <= max, got {tuple(ratio)}."
    )
  if height < 1 or width < 1:
    raise ValueError(f"random_crop_box: the image is {height}x{width}.")
  area = height * width
  log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
  for _ in range(_CROP_ATTEMPTS):
    target = area * rng.uniform(scale[0], scale[1])
    aspect = math.exp(rng.uniform(*log_ratio))
    crop_w = int(round(math.sqrt(target * aspect)))
    crop_h = int(round(math.sqrt(target / aspect)))
    if 0 < crop_w <= width and 0 < crop_h <= height:
      top = int(rng.integers(0, height - crop_h + 1))
      left = int(rng.integers(0, width - crop_w + 1))
      return top, left, crop_h, crop_w
  aspect = width / height
  if aspect < ratio[0]:
    crop_w, crop_h = width, max(1, int(round(width / ratio[0])))
  elif aspect > ratio[1]:
    crop_h, crop_w = height, max(1, int(round(height * ratio[1])))
  else:
    crop_h, crop_w = height, width
  return (height - crop_h) // 2, (width - crop_w) // 2, crop_h, crop_w


def _size_pair(size: Any, where: str) -> tuple[int, int]:
  pair = (size, size) if isinstance(size, int) else tuple(size)
  if len(pair) != 2 or not all(isinstance(s, int) and s > 0 for s in pair):
    raise ValueError(
      f"{where}: size must be an int or (height, width) of positive ints, got {size!r}."
    )
  return pair


def _image_size(data: bytes, kind: str, where: str) -> tuple[int, int]:
  if kind == "jpeg":
    simplejpeg, _ = _modules()
    try:
      height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError as e:
      raise ValueError(f"{where}: the {len(data)}-byte JPEG has no readable header: {e}") from None
    return height, width
  # PNG: the IHDR chunk follows the 8-byte signature and its header.
  if len(data) < 24:
    raise ValueError(f"{where}: the {len(data)}-byte PNG has no header.")
  width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
  return height, width


def decode_and_random_resized_crop(
  data: bytes,
  rng: np.random.Generator,
  size: int | tuple[int, int],
  scale: Sequence[float] = (0.08, 1.0),
  ratio: Sequence[float] = (3 / 4, 4 / 3),
  channels: int = 3,
  out: np.ndarray | None = None,
) -> np.ndarray:
  """Decodes a random crop (see `random_crop_box`) resized to `size`.

  JPEGs are decoded at the smallest DCT scale that keeps the crop at least
  `size` pixels.

  Args:
    data: JPEG or PNG bytes.
    rng: The random generator (e.g. the one `Dataset.random_map` passes).
    size: Output (height, width), or one int for a square.
    scale: (min, max) area fraction of the crop.
    ratio: (min, max) aspect ratio (width / height) of the crop.
    channels: 3 for RGB, 1 for gray.
    out: Where to write the result: a C-contiguous uint8 array [height, width,
      channels] (e.g. a buffer reused from image to image); None: a new one.

  Returns:
    uint8 [height, width, channels] (`out` when given).
  """
  where = "decode_and_random_resized_crop"
  out_h, out_w = _size_pair(size, where)
  _check_channels(channels, where, (1, 3))
  if out is not None:
    _check_out(out, (out_h, out_w, channels), np.uint8, where)
  kind = _format_of(data, where)
  height, width = _image_size(data, kind, where)
  top, left, crop_h, crop_w = random_crop_box(height, width, rng, scale, ratio)
  if kind == "jpeg":
    # The largest reduction (1/2, 1/4, 1/8: libjpeg's fast scaled IDCTs)
    # whose crop still has out_h x out_w pixels.
    reduction = 1
    while reduction < 8 and crop_h >= 2 * reduction * out_h and crop_w >= 2 * reduction * out_w:
      reduction *= 2
    min_size = None if reduction == 1 else (-(-height // reduction), -(-width // reduction))
    decoded = _decode_jpeg(data, channels, where, min_size)
  else:
    decoded = _decode_png(data, channels, where)
  return _resize_box(decoded, (top, left, crop_h, crop_w), (height, width), (out_h, out_w), out)


def _check_out(out: Any, shape: tuple, dtype: Any, where: str) -> None:
  """Refuses an `out` array the result cannot be written into as it is."""
  if (
    not isinstance(out, np.ndarray)
    or out.shape != tuple(shape)
    or out.dtype != dtype
    or not out.flags.c_contiguous
    or not out.flags.writeable
  ):
    described = (
      f"a {'' if out.flags.c_contiguous else 'non-'}contiguous "
      f"{'' if out.flags.writeable else 'read-only '}"
      f"{out.dtype} array of shape {out.shape}"
      if isinstance(out, np.ndarray)
      else type(out).__name__
    )
    raise ValueError(
      f"{where}: out must be a writeable C-contiguous {np.dtype(dtype)} "
      f"array of shape {tuple(shape)}, got {described}."
    )


def _resize_box(
  image: np.ndarray,
  box: tuple[int, int, int, int],
  full_size: tuple[int, int],
  size: tuple[int, int],
  out: np.ndarray | None = None,
) -> np.ndarray:
  """Resizes `box` (in full-size pixels) of a possibly scaled-down decode."""
  _, cv2 = _modules()
  top, left, crop_h, crop_w = box
  scale_y = image.shape[0] / full_size[0]
  scale_x = image.shape[1] / full_size[1]
  # Rounded to whole pixels of the decode: the decode keeps the crop at least
  # `size`, so the box moves by at most half an output pixel.
  y0, x0 = round(top * scale_y), round(left * scale_x)
  y1 = max(y0 + 1, min(image.shape[0], round((top + crop_h) * scale_y)))
  x1 = max(x0 + 1, min(image.shape[1], round((left + crop_w) * scale_x)))
  crop = image[y0:y1, x0:x1]
  if out is None:
    out = cv2.resize(crop, (size[1], size[0]), interpolation=cv2.INTER_LINEAR)
    return out if out.ndim == 3 else out[:, :, None]
  # OpenCV writes into a 2-D view for one channel (it drops the axis).
  cv2.resize(
    crop,
    (size[1], size[0]),
    dst=out if out.shape[2] > 1 else out[:, :, 0],
    interpolation=cv2.INTER_LINEAR,
  )
  return out


def random_crop(image: np.ndarray, size: Sequence[int], rng: np.random.Generator) -> np.ndarray:
  """A crop of `size` at a uniformly random place, like `tf.image.random_crop`.

  As in TensorFlow, `size` has one entry per dimension of `image` (for an
  image [height, width, channels]: (crop_height, crop_width, channels)),
  and each dimension's offset is drawn uniformly from the
  `image.shape[d] - size[d] + 1` that fit, so every crop of that size can
  come out. Use it in `Dataset.random_map`, passing the generator it gives.

  Args:
    image: An array of any rank (an image, or a batch cropped alike).
    size: The crop's shape: non-negative ints, one per dimension, each at
      most the image's.
    rng: The random generator (e.g. the one `Dataset.random_map` passes).

  Returns:
    A view of `image` (no copy) of shape `size`.

  Raises:
    ValueError: `size` has another length than `image` has dimensions, or
      an entry that is negative or larger than the image's.
  """
  image = np.asarray(image)
  crop = tuple(size)
  if len(crop) != image.ndim or not all(isinstance(c, (int, np.integer)) and c >= 0 for c in crop):
    raise ValueError(
      f"random_crop: size must be {image.ndim} non-negative ints (one per "
      f"dimension of the image of shape {image.shape}), got {tuple(size)!r}."
    )
  if any(c > n for c, n in zip(crop, image.shape)):
    raise ValueError(
      f"random_crop: size {crop} is larger than the image of shape "
      f"{image.shape}; it must fit in every dimension."
    )
  offsets = rng.integers(0, np.subtract(image.shape, crop) + 1)
  return image[tuple(slice(o, o + c) for o, c in zip(offsets.tolist(), crop))]


def flip_left_right(image: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
  """The image mirrored left to right ([..., height, width, channels]).

  Args:
    image: The image or batch of images.
    out: Where to write the result: a C-contiguous array of the image's shape
      and dtype, not the image itself; None: a new one.
  """
  image = np.asarray(image)
  where = "flip_left_right"
  if out is not None:
    _check_out(out, image.shape, image.dtype, where)
    if np.shares_memory(out, image):
      raise ValueError(f"{where}: out must not overlap the image; pass a separate array.")
  if image.ndim == 3 and image.shape[2] <= 4 and image.dtype == np.uint8:
    _, cv2 = _modules()
    if out is not None:
      cv2.flip(image, 1, dst=out if out.shape[2] > 1 else out[:, :, 0])
      return out
    flipped = cv2.flip(image, 1)
    return flipped if flipped.ndim == 3 else flipped[:, :, None]
  if out is not None:
    np.copyto(out, image[..., ::-1, :])
    return out
  return np.ascontiguousarray(image[..., ::-1, :])


def random_flip_left_right(
  image: np.ndarray, rng: np.random.Generator, out: np.ndarray | None = None
) -> np.ndarray:
  """The image, mirrored with probability 1/2 (into `out` when given).

  Without `out` an image that is not mirrored is returned as it is; with
  `out` it is copied there, so the result is always `out`.
  """
  if rng.random() < 0.5:
    return flip_left_right(image, out)
  if out is not None:
    _check_out(out, np.shape(image), np.asarray(image).dtype, "random_flip_left_right")
    np.copyto(out, image)
    return out
  return image


@functools.lru_cache(maxsize=16)
def _normalize_table(inverse: bytes, shift: bytes, channels: int) -> np.ndarray:
  """Normalize's results for the 256 uint8 values, [1, 256, channels]."""
  table = np.arange(256, dtype=np.float32)[:, None] * np.broadcast_to(
    np.frombuffer(inverse, np.float32), (channels,)
  )
  table += np.broadcast_to(np.frombuffer(shift, np.float32), (channels,))
  return table.reshape(1, 256, channels)


def normalize(
  image: np.ndarray,
  mean: Sequence[float] = IMAGENET_MEAN,
  std: Sequence[float] = IMAGENET_STD,
  out: np.ndarray | None = None,
) -> np.ndarray:
  """(image - mean) / std per channel, as float32.

  `mean` and `std` are in the image's pixel units (0..255 for uint8); the
  defaults are ImageNet's RGB statistics. `out`: where to write the result, a
  C-contiguous float32 array of the image's shape (e.g. a row of a batch);
  None: a new one.
  """
  mean = np.asarray(mean, np.float32)
  std = np.asarray(std, np.float32)
  if np.any(std == 0):
    raise ValueError(f"normalize: std must be non-zero, got {std.tolist()}.")
  inverse = 1.0 / std
  image = np.asarray(image)
  channels = image.shape[-1]
  if mean.size not in (1, channels) or inverse.size not in (1, channels):
    raise ValueError(
      f"normalize: mean and std need 1 or {channels} values (the image's "
      f"channels), got {mean.size} and {inverse.size}."
    )
  if out is None:
    out = np.empty(image.shape, np.float32)
  else:
    _check_out(out, image.shape, np.float32, "normalize")
  shift = -mean * inverse
  if (
    image.dtype == np.uint8
    and image.ndim >= 2
    and 1 <= channels <= 4
    and 0 < image.size < _LUT_MAX_SIZE
  ):
    # A uint8 image has 256 values per channel: OpenCV looks each pixel up
    # in a table of the float32 results, one pass that writes `out` once
    # (about half the time of the cast, scale and shift below, whose three
    # passes read and write 4-byte values). The table is computed with the
    # very float32 operations below, so the results are the same bits.
    _, cv2 = _modules()
    width = image.shape[-2]
    cv2.LUT(
      np.ascontiguousarray(image).reshape(-1, width, channels),
      _normalize_table(inverse.tobytes(), shift.tobytes(), channels),
      dst=out.reshape(-1, width, channels),
    )
    return out
  # Cast first, then scale and shift in place: NumPy's float32 loops are
  # vectorized, while a uint8 * float32 multiply casts through a small
  # buffer at twice the cost. Rows of width * channels values, so the inner
  # loop runs over a whole row rather than over 3 channels at a time.
  np.copyto(out, image, casting="unsafe")
  row = image.shape[-2] * channels if image.ndim >= 2 else channels
  rows = out.reshape(-1, row)
  rows *= np.resize(np.broadcast_to(inverse, (channels,)), row)
  rows += np.resize(np.broadcast_to(shift, (channels,)), row)
  return out


try:
  # The decoders load with the module, so that a worker process loads them
  # with the functions it is sent, before its first image.
  _modules()
except ImportError:
  pass  # raised where a decoder is used
