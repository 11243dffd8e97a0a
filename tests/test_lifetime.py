"""Children end with the process that started them (jaxfeed._lifetime).

Each test runs a parent process that starts a child, then SIGKILLs the
parent (no cleanup runs) and checks that the child is gone within seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from jaxfeed import _lifetime

pytestmark = pytest.mark.timeout(60)

# The parent: starts a child (`python -c CHILD`) with `how`, waits until the
# child says it is set up, prints the child's pid, then sleeps until killed.
_PARENT = textwrap.dedent("""
    import subprocess, sys, threading, time
    from jaxfeed import _lifetime
    how, child = sys.argv[1], sys.argv[2]
    args = [sys.executable, "-c", child]
    started = []
    if how == "popen_from_a_thread_that_ends":
      thread = threading.Thread(target=lambda: started.append(
          _lifetime.popen(args, stdout=subprocess.PIPE)))
      thread.start()
      thread.join()
    elif how == "plain":
      started.append(subprocess.Popen(args, stdout=subprocess.PIPE))
    assert started[0].stdout.readline() == b"ready\\n"
    print(started[0].pid, flush=True)
    time.sleep(600)
""")
_READY = "print('ready', flush=True); time.sleep(600)"
_CHILD_FROM_ENV = (
  f"from jaxfeed import _lifetime; import time; _lifetime.die_with_parent_from_env(); {_READY}"
)
_CHILD_DEATHSIG_ONLY = (
  "from jaxfeed import _lifetime; import time; "
  f"assert _lifetime.set_parent_death_signal(); {_READY}"
)
_CHILD_WATCH_ONLY = (
  "import os, time; from jaxfeed import _lifetime; "
  "_lifetime.die_with_parent(os.getppid(), deathsig=False, poll_s=0.1); "
  f"{_READY}"
)


def _start_parent(how: str, child: str) -> tuple[subprocess.Popen, psutil.Process]:
  parent = subprocess.Popen(
    [sys.executable, "-c", _PARENT, how, child], stdout=subprocess.PIPE, text=True
  )
  child_pid = int(parent.stdout.readline())
  return parent, psutil.Process(child_pid)


def _gone_within(process: psutil.Process, seconds: float) -> bool:
  try:
    process.wait(timeout=seconds)
  except psutil.TimeoutExpired:
    return False
  except psutil.NoSuchProcess:
    pass
  return True


def _kill(parent: subprocess.Popen, child: psutil.Process) -> None:
  parent.kill()
  parent.wait()
  try:
    child.kill()
  except psutil.NoSuchProcess:
    pass


@pytest.mark.parametrize(
  "how, child",
  [
    ("popen_from_a_thread_that_ends", _CHILD_FROM_ENV),
    ("popen_from_a_thread_that_ends", _CHILD_DEATHSIG_ONLY),
    ("plain", _CHILD_WATCH_ONLY),
  ],
  ids=["deathsig_and_watch", "deathsig_only", "watch_only"],
)
def test_a_child_ends_with_its_sigkilled_parent(how, child):
  parent, process = _start_parent(how, child)
  try:
    time.sleep(1.0)  # the thread that started it has ended: the child must live on
    assert process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    parent.send_signal(signal.SIGKILL)
    assert _gone_within(process, 5), f"child {process.pid} outlived its parent by 5 s"
  finally:
    _kill(parent, process)


def test_a_child_whose_parent_died_before_it_watched_ends_at_once():
  child = subprocess.Popen(
    [
      sys.executable,
      "-c",
      "from jaxfeed import _lifetime; import time; _lifetime.die_with_parent(1); time.sleep(600)",
    ]
  )
  # Its parent is this process, not pid 1: as if pid 1 had died meanwhile.
  assert child.wait(timeout=30) == -signal.SIGKILL


def test_popen_names_this_process_to_the_child_and_run_returns_its_output():
  result = _lifetime.run(
    [sys.executable, "-c", f"import os; print(os.environ[{_lifetime.PARENT_PID_ENV!r}])"],
    stdout=subprocess.PIPE,
    text=True,
    timeout=30,
  )
  assert int(result.stdout) == os.getpid() and result.returncode == 0
