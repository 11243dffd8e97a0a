"""tf.data service's name for ephemeral sharing: `CrossTrainerCache`.

`distribute(..., job_name=J, cross_trainer_cache=CrossTrainerCache(trainer_id=T))`
lets several trainers read one pipeline's output, each all of it at its own
pace, from what the workers produce once. jaxfeed does this with ephemeral
sharing (`ephemeral_sharing=True`, see `jaxfeed.service.worker.shared_stream`):
each trainer reads its own parallel_epochs job, named after J and T, and the
jobs of one dataset share each worker's pipeline through a byte-bounded
window. Clients with the same J and T share one job (they split that
trainer's data, as tf.data's clients of one trainer id do).
"""

from __future__ import annotations

import dataclasses

from jaxfeed.service.protocol.sharding import ShardingPolicy


@dataclasses.dataclass(frozen=True)
class CrossTrainerCache:
  """Options for sharing one pipeline's output among trainers.

  Attributes:
    trainer_id: names the trainer: clients with the same id read as one
      trainer; each trainer id reads every element.
  """

  trainer_id: str

  def __post_init__(self):
    if not isinstance(self.trainer_id, str) or not self.trainer_id:
      raise ValueError(
        f"CrossTrainerCache: trainer_id must be a non-empty string, got {self.trainer_id!r}."
      )


def trainer_job_name(
  cache: CrossTrainerCache, job_name: str | None, policy: ShardingPolicy, num_consumers: int | None
) -> str:
  """The job a trainer reads (tf.data's checks first).

  Raises:
    ValueError: no job_name, a round-robin read, or not parallel_epochs.
  """
  if not isinstance(cache, CrossTrainerCache):
    raise ValueError(
      f"cross_trainer_cache must be a jaxfeed.service.CrossTrainerCache, got {cache!r:.80}."
    )
  if not job_name:
    raise ValueError(
      "Cross-trainer caching requires named jobs: pass a job_name (the same for every trainer)."
    )
  if num_consumers is not None:
    raise ValueError(
      f"Cross-trainer caching does not support coordinated reads (num_consumers={num_consumers})."
    )
  if policy != ShardingPolicy.OFF:
    raise ValueError(
      "Cross-trainer caching needs processing_mode='parallel_epochs' "
      f"(OFF), got {policy.name}: every trainer reads all the data."
    )
  return f"{job_name}/trainer:{cache.trainer_id}"
