"""Graph fingerprints hash what a pipeline computes, UDFs included."""

import os
import subprocess
import sys
import threading
import types

import numpy as np
import pytest

import fingerprint_pipelines
import jaxfeed
from jaxfeed.ops import fingerprint

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))


def mapped(fn) -> str:
  return jaxfeed.Dataset.range(4).map(fn).fingerprint()


def test_closures_of_one_factory_with_different_cells_differ():
  make = fingerprint_pipelines.make
  assert mapped(make(2)) != mapped(make(3))
  assert mapped(make(2)) == mapped(make(2))


def test_lambdas_differ_by_their_code_and_agree_when_equal():
  assert mapped(lambda x: x + 1) != mapped(lambda x: x + 2)
  assert mapped(lambda x: x * 2) != mapped(lambda x: x**2)
  assert mapped(lambda x: x + 1) == mapped(lambda x: x + 1)


def test_closure_cells_are_hashed_by_content():
  with_state = fingerprint_pipelines.with_state
  weights = np.arange(5.0)
  other = weights.copy()
  other[3] = -1.0
  assert mapped(with_state({"weights": weights})) == mapped(with_state({"weights": weights.copy()}))
  assert mapped(with_state({"weights": weights})) != mapped(with_state({"weights": other}))
  assert mapped(with_state({"weights": weights})) != mapped(
    with_state({"weights": weights.astype(np.float32)})
  )


def test_defaults_and_keyword_defaults_differ():
  assert mapped(lambda x, k=2: x * k) != mapped(lambda x, k=3: x * k)
  assert mapped(lambda x, *, k=2: x * k) != mapped(lambda x, *, k=3: x * k)
  # A numpy scalar and a Python float give other dtypes in numpy arithmetic.
  assert mapped(lambda x, k=2.0: x * k) != mapped(lambda x, k=np.float64(2.0): x * k)


def function_with_globals(source: str, name: str, **globals_) -> types.FunctionType:
  namespace = dict(globals_)
  exec(source, namespace)  # pylint: disable=exec-used
  return namespace[name]


def test_different_referenced_globals_differ():
  source = "def f(x):\n  return x * SCALE\n"
  two = function_with_globals(source, "f", SCALE=2)
  assert mapped(two) != mapped(function_with_globals(source, "f", SCALE=3))
  assert mapped(two) == mapped(function_with_globals(source, "f", SCALE=2))


def test_a_helper_called_through_a_global_is_hashed_by_its_code():
  source = "def f(x):\n  return helper(x) + 1\n"
  plus = function_with_globals(source, "f", helper=lambda x: x + 1)
  times = function_with_globals(source, "f", helper=lambda x: x * 2)
  assert mapped(plus) != mapped(times)


def test_module_globals_and_helpers_of_an_importable_udf_are_hashed():
  module = types.ModuleType("fingerprint_module_under_test")
  module.__file__ = os.path.join(HERE, "fingerprint_module_under_test.py")
  module.__dict__["SCALE"] = 2
  exec(
    "def helper(x):\n  return x * SCALE\n"  # pylint: disable=exec-used
    "def f(x):\n  return helper(x) + 1\n"
    "def g(x, *, k=2):\n  return x * k\n",
    module.__dict__,
  )
  sys.modules[module.__name__] = module
  try:
    before = mapped(module.f)
    module.SCALE = 3
    assert mapped(module.f) != before
    module.SCALE = 2
    assert mapped(module.f) == before
    exec(
      "def helper(x):\n  return x * SCALE + 0\n",  # pylint: disable=exec-used
      module.__dict__,
    )
    assert mapped(module.f) != before
    g = mapped(module.g)
    exec(
      "def g(x, *, k=3):\n  return x * k\n",  # pylint: disable=exec-used
      module.__dict__,
    )
    assert mapped(module.g) != g
  finally:
    del sys.modules[module.__name__]


def test_mutable_module_state_a_udf_updates_does_not_change_it():
  before = mapped(fingerprint_pipelines.counting)
  fingerprint_pipelines.counting(1)
  assert mapped(fingerprint_pipelines.counting) == before


def test_recursive_functions_and_cyclic_values_are_hashed():
  cycle = []
  cycle.append(cycle)
  assert mapped(fingerprint_pipelines.recursive) == mapped(fingerprint_pipelines.recursive)
  assert mapped(lambda x, c=cycle: x) == mapped(lambda x, c=cycle: x)


def test_objects_without_hashable_content_never_match_another_object():
  lock, other_lock = threading.Lock(), threading.Lock()
  assert mapped(lambda x, l=lock: x) == mapped(lambda x, l=lock: x)  # same object
  assert mapped(lambda x, l=lock: x) != mapped(lambda x, l=other_lock: x)


def test_plain_objects_are_hashed_by_their_fields():
  class Scale:
    def __init__(self, k):
      self.k = k

    def __call__(self, x):
      return x * self.k

  assert mapped(Scale(2)) == mapped(Scale(2))
  assert mapped(Scale(2)) != mapped(Scale(3))
  assert mapped(Scale(2).__call__) != mapped(Scale(3).__call__)


def test_the_same_pipeline_has_the_same_fingerprint_in_other_processes():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, HERE, env.get("PYTHONPATH", "")])
  env["JAX_PLATFORMS"] = "cpu"
  script = "import fingerprint_pipelines; print(fingerprint_pipelines.build().fingerprint())"
  children = []
  for seed in ("1", "2"):  # str and set hashing differ between the two
    env["PYTHONHASHSEED"] = seed
    children.append(
      subprocess.Popen(
        [sys.executable, "-c", script], env=dict(env), stdout=subprocess.PIPE, text=True
      )
    )
  printed = [child.communicate(timeout=120)[0].strip() for child in children]
  assert [child.returncode for child in children] == [0, 0]
  assert printed == [fingerprint_pipelines.build().fingerprint()] * 2


def test_numpy_arrays_are_hashed_by_content():
  a = np.arange(10)
  assert fingerprint.digest(a) == fingerprint.digest(a.copy())
  assert fingerprint.digest(a) != fingerprint.digest(a[::-1].copy())
  assert fingerprint.digest(a) != fingerprint.digest(a.reshape(2, 5))
  assert fingerprint.digest(a[::2]) == fingerprint.digest(np.arange(0, 10, 2))
  assert fingerprint.digest(np.zeros((0, 3))) != fingerprint.digest(np.zeros((3, 0)))
  dates = np.array(["2020-01-01", "2021-01-01"], "datetime64[D]")
  assert fingerprint.digest(dates) != fingerprint.digest(dates[::-1].copy())
  assert fingerprint.digest(np.array(5)) != fingerprint.digest(np.array([5]))
  assert (
    jaxfeed.Dataset.from_tensor_slices(a).fingerprint()
    != jaxfeed.Dataset.from_tensor_slices(a + 1).fingerprint()
  )


@pytest.mark.parametrize(
  "value", [1, 1.0, True, "1", b"1", (1,), [1], {1: 1}, {1}, np.int64(1), np.float32(1), None]
)
def test_values_of_different_types_differ(value):
  others = [1, 1.0, True, "1", b"1", (1,), [1], {1: 1}, {1}, np.int64(1), np.float32(1), None]
  matches = [o for o in others if fingerprint.digest(o) == fingerprint.digest(value)]
  assert len(matches) == 1


def test_frozen_dataclass_module_constants_are_hashed_by_value():
  module = types.ModuleType("fingerprint_config_module_under_test")
  module.__file__ = os.path.join(HERE, "fingerprint_config_module_under_test.py")
  exec(
    "import dataclasses\n"  # pylint: disable=exec-used
    "@dataclasses.dataclass(frozen=True)\n"
    "class Config:\n  scale: int\n"
    "CONFIG = Config(2)\n"
    "def f(x):\n  return x * CONFIG.scale\n",
    module.__dict__,
  )
  sys.modules[module.__name__] = module
  try:
    before = mapped(module.f)
    module.CONFIG = module.Config(3)
    assert mapped(module.f) != before
  finally:
    del sys.modules[module.__name__]


def test_only_fingerprints_without_a_nonce_are_reproducible():
  lock = threading.Lock()
  assert jaxfeed.Dataset.range(4).map(lambda x: x + 1).fingerprint().reproducible
  held = jaxfeed.Dataset.range(4).map(lambda x, l=lock: x)
  assert not held.fingerprint().reproducible
  assert not held.batch(2).fingerprint().reproducible  # downstream too
  zipped = jaxfeed.Dataset.zip((jaxfeed.Dataset.range(4), held))
  assert not zipped.fingerprint().reproducible


def test_closures_in_module_state_are_module_state():
  module = types.ModuleType("fingerprint_closure_module_under_test")
  module.__file__ = os.path.join(HERE, "fingerprint_closure_module_under_test.py")
  exec(
    "import threading\n"  # pylint: disable=exec-used
    "def make(guard):\n"
    "  def locked(x):\n    with guard:\n      return x + 1\n"
    "  return locked\n"
    "helper = make(threading.Lock())\n"
    "def f(x):\n  return helper(x)\n",
    module.__dict__,
  )
  sys.modules[module.__name__] = module
  try:
    # The lock is made by the module's code on every host: named, not a nonce.
    assert jaxfeed.Dataset.range(4).map(module.f).fingerprint().reproducible
    assert fingerprint.digest(module.f) == fingerprint.digest(module.f)
  finally:
    del sys.modules[module.__name__]


def test_autocache_keeps_nothing_under_a_fingerprint_that_is_not_reproducible(tmp_path):
  from jaxfeed.ops import autocache  # pylint: disable=g-import-not-at-top

  lock = threading.Lock()
  kept = jaxfeed.Dataset.range(4).map(lambda x: x + 1).autocache()
  passed = jaxfeed.Dataset.range(4).map(lambda x, l=lock: x + 1).autocache()
  for dataset, cache_dir in [(kept, tmp_path / "kept"), (passed, tmp_path / "passed")]:
    cache_dir.mkdir()
    autocache.point_at(dataset.node, str(cache_dir), policy="always")
    assert [int(x) for x in dataset] == [1, 2, 3, 4]
  entries = lambda folder: [p for p in folder.iterdir() if p.name != ".jaxfeed"]  # bookkeeping
  assert len(entries(tmp_path / "kept")) == 1
  assert not entries(tmp_path / "passed")
