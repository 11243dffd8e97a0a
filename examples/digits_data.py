"""The digits records and the example's UDFs, in a module of their own.

Service workers import UDFs by their module path; functions defined in the
trainer's `__main__` would not be importable there.
"""

from __future__ import annotations

import numpy as np

IMAGE_SIZE = 8
NUM_CLASSES = 10
_RECORD_BYTES = 4 + IMAGE_SIZE * IMAGE_SIZE


def encode_record(image: np.ndarray, label: int) -> bytes:
  """A record: int32 label (little endian) then 64 uint8 pixels."""
  return np.int32(label).tobytes() + image.astype(np.uint8).tobytes()


def decode_record(record: bytes) -> dict[str, np.ndarray]:
  """Inverse of `encode_record`; pixels scaled to [0, 1]."""
  if len(record) != _RECORD_BYTES:
    raise ValueError(f"digits record has {len(record)} bytes, expected {_RECORD_BYTES}")
  label = np.frombuffer(record, np.int32, count=1)[0]
  pixels = np.frombuffer(record, np.uint8, offset=4).reshape(IMAGE_SIZE, IMAGE_SIZE)
  return {"image": pixels.astype(np.float32) / 16.0, "label": label}


def augment(example: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
  """Shifts the image by up to one pixel in each direction (zero fill)."""
  dy, dx = rng.integers(-1, 2, size=2)
  image = np.roll(example["image"], (dy, dx), axis=(0, 1))
  if dy:
    image[0 if dy > 0 else -1, :] = 0.0
  if dx:
    image[:, 0 if dx > 0 else -1] = 0.0
  return {"image": image, "label": example["label"]}
