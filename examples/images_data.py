"""The image records of `examples/train_images.py` and its UDFs.

The photographs are the two that ship with scikit-learn
(`sklearn.datasets.load_sample_images()`: a Chinese temple and a flower, 427 x
640), so nothing is downloaded. Each record is a tf.train.Example holding a
random crop of one photograph's top or bottom half, resized to one of a few
sizes and re-encoded as JPEG, and its class: which photograph, which half.

Service workers import UDFs by their module path, so they live here rather
than in the trainer's `__main__`.
"""

from __future__ import annotations

import io
import os

import numpy as np

from jaxfeed import example as jex

NUM_CLASSES = 4  # (china, flower) x (top, bottom)
CLASS_NAMES = ("china-top", "china-bottom", "flower-top", "flower-bottom")
ENCODED_SIZES = (64, 96, 128, 192)

FEATURES = {
  "image/encoded": jex.FixedLenFeature([], bytes),
  "image/class/label": jex.FixedLenFeature([], np.int64),
}


def photographs() -> list[np.ndarray]:
  """scikit-learn's sample photographs, uint8 [427, 640, 3] each."""
  from sklearn.datasets import load_sample_images  # pylint: disable=g-import-not-at-top

  return [np.asarray(image) for image in load_sample_images().images]


def random_crop_jpegs(
  count: int, seed: int, sizes=ENCODED_SIZES, min_side: int = 64, quality: int = 90
):
  """Yields (jpeg bytes, class) of `count` random crops, re-encoded.

  A crop is a random square of one photograph's top or bottom half (class
  2 * photograph + half), resized to a size drawn from `sizes`.
  """
  from PIL import Image  # pylint: disable=g-import-not-at-top

  images = photographs()
  rng = np.random.default_rng(seed)
  for _ in range(count):
    label = int(rng.integers(NUM_CLASSES))
    photo = images[label // 2]
    half_height = photo.shape[0] // 2
    half = photo[half_height * (label % 2) : half_height * (label % 2 + 1)]
    side = int(rng.integers(min_side, half.shape[0] + 1))
    top = int(rng.integers(0, half.shape[0] - side + 1))
    left = int(rng.integers(0, half.shape[1] - side + 1))
    size = int(sizes[rng.integers(len(sizes))])
    crop = Image.fromarray(half[top : top + side, left : left + side])
    buffer = io.BytesIO()
    crop.resize((size, size), Image.BILINEAR).save(buffer, "JPEG", quality=quality)
    yield buffer.getvalue(), label


def prepare_images(data_dir: str, num_records: int, seed: int = 0) -> str:
  """Writes the records to one TFRecord file once; returns its path."""
  import jaxfeed  # pylint: disable=g-import-not-at-top

  path = os.path.join(data_dir, f"images-{num_records}-{seed}.tfrecord")
  if os.path.exists(path):
    return path
  os.makedirs(data_dir, exist_ok=True)
  records = (
    jex.make_example({"image/encoded": jpeg, "image/class/label": label})
    for jpeg, label in random_crop_jpegs(num_records, seed)
  )
  tmp = path + ".tmp"
  jaxfeed.write_tfrecord(tmp, records)
  os.replace(tmp, path)
  return path


def parse_record(record: bytes) -> dict:
  """The Example's JPEG bytes and int32 label."""
  example = jex.parse_single_example(record, FEATURES)
  return {
    "jpeg": example["image/encoded"].item(),
    "label": example["image/class/label"].astype(np.int32),
  }


class Augment:
  """Random resized crop to `size`, random flip, normalize (float32).

  For `random_map(..., writes_out=True)`: the image is normalized straight
  into `out["image"]`, its batch row, when the pipeline hands one out.
  """

  def __init__(self, size: int):
    self.size = size

  def __call__(self, example: dict, rng: np.random.Generator, out: dict | None = None) -> dict:
    from jaxfeed import image  # pylint: disable=g-import-not-at-top

    pixels = image.decode_and_random_resized_crop(
      example["jpeg"], rng, self.size, scale=(0.25, 1.0)
    )
    pixels = image.random_flip_left_right(pixels, rng)
    return {
      "image": image.normalize(pixels, out=None if out is None else out["image"]),
      "label": example["label"],
    }
