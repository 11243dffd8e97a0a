"""A `gs://` bucket kept in a local folder, through etils.epath's own mock
backend, so code that must go through epath (not `os` or `open`) is checked:
a path handled by `os` would look for a folder literally named 'gs:'."""

import contextlib
import os
from typing import Iterator
from unittest import mock

from etils.epath import gpath
from etils.epath import testing

BUCKET = "gs://jaxfeed-test-bucket"


@contextlib.contextmanager
def bucket_in(root: os.PathLike) -> Iterator[str]:
  """Within the block, `BUCKET/...` paths are files under `root`."""
  root = os.fspath(root)

  def local(path) -> str:
    # The mock stands in for every backend, the local one too.
    path = os.fspath(path)
    return root + path[len(BUCKET) :] if path.startswith(BUCKET) else path

  def one(original, path, *args, **kwargs):
    return original(local(path), *args, **kwargs)

  def two(original, src, dst, *args, **kwargs):
    return original(local(src), local(dst), *args, **kwargs)

  def listdir(original, path):
    return original(local(path))

  # With TensorFlow installed, epath sends gs:// to tf.io.gfile directly,
  # past the backends the mock replaces.
  with (
    mock.patch.object(gpath, "_is_tf_installed", lambda: False),
    testing.mock_epath(
      open=one,
      exists=one,
      isdir=one,
      listdir=listdir,
      makedirs=one,
      mkdir=one,
      remove=one,
      rename=two,
      replace=two,
      rmtree=one,
      stat=one,
      copy=two,
    ),
  ):
    yield BUCKET
