"""Coordinated reads: every host trains on the same sequence-length bucket.

Serviceless mode: every host builds the same `BucketPlan` from a per-record
length index (`compute_lengths`) and a seed, and reads its slice of each step's
global batch through `jaxfeed.Dataset.from_bucket_plan`.

Service mode, for lengths known only after preprocessing:
`ds.bucket_by_sequence_length(...).distribute(service, job_name=...,
num_consumers=K, consumer_index=i)`. At every round one worker hands all K
consumers a batch each from one window of K batches with the same padded
shapes; partial windows are dropped, and a consumer later than
`round_timeout_s` loses the rounds it missed (`jaxfeed.service.client` and
`jaxfeed.service.worker.round_assembly` give the rules).
"""

from jaxfeed.coord.bucket_plan import BucketPlan
from jaxfeed.coord.bucket_plan_dataset import BucketPlanNode
from jaxfeed.coord.bucket_plan_dataset import RecordLengthMismatchError
from jaxfeed.coord.length_index import LengthIndexError
from jaxfeed.coord.length_index import compute_lengths

__all__ = [
  "BucketPlan",
  "BucketPlanNode",
  "LengthIndexError",
  "RecordLengthMismatchError",
  "compute_lengths",
]
