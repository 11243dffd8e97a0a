"""Whether the dispatcher's journal can make changes durable
(`JournalHealth`), and the error a change gets while it cannot.

A full disk. A batch whose write fails stays in memory, in order, and the
journal is unhealthy (`healthy`; the dispatcher's health service and
`jaxfeed_dispatcher_journal_healthy` say so). Changes that must be durable
before their answer are refused with UNAVAILABLE meanwhile (callers retry),
while heartbeats go on: what they change is kept in memory and written once
the disk takes it. The journal's thread retries every RETRY_S; once the
waiting bytes are written and fsynced the journal is healthy again, and the
dispatcher serves every call, with no restart. Should more than
`journal.MAX_UNWRITTEN_BYTES` wait, or an fsync fail, the journal fails for
good (`failed`): after a failed fsync the kernel may have dropped the pages
it could not write, and a later fsync would succeed without them
(PostgreSQL stops there too), so only a restart that replays what the disk
holds knows the state. The command-line dispatcher then exits with status
`journal.FATAL_EXIT_STATUS` for its supervisor to restart it.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Callable

from jaxfeed.service.protocol import rpc

RETRY_S = 0.5  # between tries to write what a full disk refused


class JournalUnavailableError(rpc.StatusError):
  """The journal cannot take a change now (its disk refused a write, or it
  failed): answered UNAVAILABLE, which callers retry."""

  def __init__(self, message: str):
    super().__init__("UNAVAILABLE", message)


class JournalHealth:
  """The health of the journal in `work_dir`: the error of the write its
  disk last refused (until a write succeeds), the failure it gave up on,
  and who is told when `healthy` changes. Its owner serializes the changes
  (the journal's lock)."""

  def __init__(self, work_dir: pathlib.Path):
    self.work_dir = work_dir
    self.write_error: OSError | None = None  # unhealthy while set
    self.failure: BaseException | None = None  # failed for good
    self._listeners: list[Callable[[bool], None]] = []

  @property
  def healthy(self) -> bool:
    """Whether every batch accepted could be written (a full disk: not)."""
    return self.write_error is None and self.failure is None

  @property
  def failed(self) -> bool:
    """Whether the journal gave up (a failed fsync, too much waiting in
    memory): only a restart serves again."""
    return self.failure is not None

  def add_listener(self, listener: Callable[[bool], None]) -> None:
    """Calls `listener(healthy)` whenever `healthy` changes (from the thread
    that noticed)."""
    self._listeners.append(listener)

  def notify(self) -> None:
    """Tells the listeners whether the journal is healthy now."""
    healthy = self.healthy
    for listener in list(self._listeners):
      try:
        listener(healthy)
      except Exception:  # pylint: disable=broad-except
        logging.exception("A journal health listener failed")

  def check_writable(self) -> None:
    """Raises JournalUnavailableError unless changes can be made durable now."""
    if self.failure is not None:
      raise JournalUnavailableError(self.failure_message())
    if self.write_error is not None:
      raise JournalUnavailableError(
        f"The dispatcher cannot write its journal in {self.work_dir} "
        f"({self.write_error.strerror or self.write_error}): changes wait until "
        f"the disk takes writes again (it retries every {RETRY_S:g} s; heartbeats "
        "go on meanwhile). Retry the call."
      )

  def failure_message(self) -> str:
    return (
      f"The dispatcher's journal in {self.work_dir} failed ({self.failure}); "
      "it accepts no more changes and must be restarted: it replays every "
      "change that was acknowledged."
    )

  def write_failed(self, path: pathlib.Path, error: OSError) -> None:
    """The disk refused a write to the journal file `path`."""
    if self.write_error is None:
      logging.error(
        "Writing the dispatcher journal %s failed (%s): changes that must "
        "be durable are refused until the disk takes writes again; "
        "retrying every %g s.",
        path,
        error,
        RETRY_S,
      )
    self.write_error = error

  def wrote(self, path: pathlib.Path) -> None:
    """Everything waiting was written to the journal file `path`."""
    if self.write_error is not None:
      logging.warning("The dispatcher journal %s takes writes again.", path)
      self.write_error = None

  def fail(self, error: BaseException) -> None:
    """Gives up for good."""
    if self.failure is None:
      logging.critical(
        "The dispatcher journal in %s failed (%s): it accepts no more "
        "changes; restart the dispatcher to replay what the disk holds.",
        self.work_dir,
        error,
      )
      self.failure = error
