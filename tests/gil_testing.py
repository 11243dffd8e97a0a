"""Whether code hands the GIL over while it runs (for tests of either)."""

import sys
import threading


def spinner_count_during(work) -> int:
  """How often a Python thread loops while `work()` runs in this one.

  With a 1 s switch interval a thread waiting for the GIL gets it only when
  the holder releases it itself (as C code does around blocking work), so the
  count is 0 if `work` holds the GIL throughout and large if it releases it.
  """
  counts = []
  start, done = threading.Event(), threading.Event()

  def spin():
    start.wait()
    count = 0
    while not done.is_set():
      count += 1
    counts.append(count)

  interval = sys.getswitchinterval()
  sys.setswitchinterval(1.0)
  spinner = threading.Thread(target=spin)
  spinner.start()
  try:
    start.set()
    work()
  finally:
    done.set()
    spinner.join()
    sys.setswitchinterval(interval)
  return counts[0]
