"""Module-level UDFs the service tests ship to worker processes by import path."""

import os

import numpy as np


def add_one(x):
  return x + 1


def add_one_to_x(element):
  return {**element, "x": element["x"] + 1}


def with_worker_pid(element):
  """The element and the process (worker) that made it."""
  import os  # pylint: disable=g-import-not-at-top

  return {**element, "pid": np.int64(os.getpid())}


def fails_at_five(x):
  if x == 5:
    raise ValueError("element five is bad")
  return x


def slow_add_one_to_x(element):
  import time  # pylint: disable=g-import-not-at-top

  time.sleep(0.002)
  return {**element, "x": element["x"] + 1}


def decode_record(record):
  """TFRecord payload: 4-byte int32 label then the raw bytes of x (int64)."""
  data = np.frombuffer(record, dtype=np.uint8)
  return {"label": data[:4].view(np.int32)[0], "x": data[4:].view(np.int64)[0]}


def trim_tokens(record):
  """A fixed-width token row cut to the record's length, with its id."""
  return {"tokens": record["tokens"][: record["length"]], "id": record["id"]}


def token_count(element):
  return element["tokens"].shape[0]


def add_payload(element):
  """A 64 KiB leaf per element, so that batches outgrow socket buffers."""
  return {**element, "payload": np.zeros(1 << 16, np.uint8)}


CALLS = {"counted": 0}  # in-process workers only: how often `counted` ran


def counted(x):
  """x with a 1 MiB payload (so that socket buffers hold few elements)."""
  CALLS["counted"] += 1
  return {"x": x, "payload": np.zeros(1 << 20, np.uint8)}


def sleepy(x):
  """5 ms of waiting per element: a pipeline more workers speed up."""
  import time  # pylint: disable=g-import-not-at-top

  time.sleep(0.005)
  return x


def tally(x):
  """{"x": x}, counting calls in CALLS["tally"] (in-process workers)."""
  CALLS["tally"] = CALLS.get("tally", 0) + 1
  return {"x": x}


def mark_batched(x):
  """{"x": x, "batched": whether x came as a batch} (a batchable map)."""
  return {"x": x, "batched": np.full(np.shape(x), np.ndim(x) > 0)}


_CONCURRENT = {"now": 0, "most": 0}


def most_concurrent(x):
  """{"x": x, "most": the most calls of this UDF seen running at once in
  this process}; each call waits 20 ms, so more threads run more calls."""
  import threading  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top

  lock = _CONCURRENT.setdefault("lock", threading.Lock())
  with lock:
    _CONCURRENT["now"] += 1
    _CONCURRENT["most"] = max(_CONCURRENT["most"], _CONCURRENT["now"])
  time.sleep(0.02)
  with lock:
    _CONCURRENT["now"] -= 1
    return {"x": x, "most": _CONCURRENT["most"]}


def paced(x):
  """{"x": x} after 30 ms: a read that lasts long enough for several
  consumers of a shared job to each take part of it."""
  import time  # pylint: disable=g-import-not-at-top

  time.sleep(0.03)
  return {"x": x}


def paced_record(element):
  """`element` after 20 ms: a split takes long enough that a second worker
  of a job takes splits too, whichever worker starts first."""
  import time  # pylint: disable=g-import-not-at-top

  time.sleep(0.02)
  return element


def dawdle(x):
  """{"x": x} after a second: a worker's connection waits for the next
  element longer than a heartbeat."""
  import time  # pylint: disable=g-import-not-at-top

  time.sleep(1.0)
  return {"x": x}


POISON = 13  # the record the poison UDFs below fail on


def segfault_at_poison(x):
  """x, but a real segmentation fault in the worker on record POISON."""
  if int(x) == POISON:
    import ctypes  # pylint: disable=g-import-not-at-top

    ctypes.string_at(0)
  return x


def hang_at_poison(x):
  """x, but never returns on record POISON (the worker lives on)."""
  if int(x) == POISON:
    import threading  # pylint: disable=g-import-not-at-top

    threading.Event().wait()
  return x


def spin_at_poison(x):
  """x, but on record POISON spins in C holding the GIL for ever (a regular
  expression that backtracks 2**64 times): no other thread of the worker runs."""
  if int(x) == POISON:
    import re  # pylint: disable=g-import-not-at-top

    re.match(r"(a+)+$", "a" * 64 + "b")
  return x


# The chaos suite's poison record: "VALUE,KIND,FOLDER" in the workers'
# environment. KIND "always": every worker that maps x == VALUE segfaults;
# "once": only the first one. Each death leaves a file "died-PID" in FOLDER.
POISON_ENV = "JAXFEED_TEST_POISON"


def _strike_if_poison(element):
  import os  # pylint: disable=g-import-not-at-top

  spec = os.environ.get(POISON_ENV)
  if not spec:
    return
  value, kind, folder = spec.split(",", 2)
  if int(element["x"]) != int(value):
    return
  if kind == "once":
    try:
      os.close(os.open(os.path.join(folder, "struck"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
      return
  with open(os.path.join(folder, f"died-{os.getpid()}"), "w"):
    pass
  import ctypes  # pylint: disable=g-import-not-at-top

  ctypes.string_at(0)


def poisoned_add_one_to_x(element):
  _strike_if_poison(element)
  return add_one_to_x(element)


def poisoned_slow_add_one_to_x(element):
  _strike_if_poison(element)
  return slow_add_one_to_x(element)


def tfrecord_file(path):
  """interleave's fn: the decoded records of one TFRecord file (its name as bytes)."""
  import jaxfeed  # pylint: disable=g-import-not-at-top

  name = path.decode() if isinstance(path, bytes) else str(path)
  return jaxfeed.Dataset.from_tfrecord(name).map(decode_record)


def sleepy_20ms(x):
  """20 ms of waiting per element: a pipeline that needs 4 times sleepy's workers."""
  import time  # pylint: disable=g-import-not-at-top

  time.sleep(0.02)
  return x


def logged_triple(element):
  """{"x": 3x}, logging each call as one byte in $JAXFEED_TEST_CALLS (any
  process, so that tests count calls made in worker processes)."""
  with open(os.environ["JAXFEED_TEST_CALLS"], "ab") as f:
    f.write(b".")
  return {"x": element["x"] * 3}


def _spin(seconds: float) -> None:
  import time  # pylint: disable=g-import-not-at-top

  started = time.perf_counter()
  while time.perf_counter() - started < seconds:
    pass


def costly(x):
  """{"x": x} after 2 ms of CPU: worth caching."""
  _spin(2e-3)
  return {"x": x}


def costly_record(element):
  """`element` after 2 ms of CPU: worth keeping by record."""
  _spin(2e-3)
  return element


def big_cheap(x):
  """{"x": x, "pad": 256 KiB of zeros}: made in microseconds, slower to
  read back from a cache than to make."""
  pad = np.zeros(1 << 16, np.float32)
  pad[0] = x
  return {"x": x, "pad": pad}
