"""Coordinated reads: every host trains on the same sequence-length bucket.

Serviceless mode: every host builds the same `BucketPlan` from a per-record
length index (`compute_lengths`) and a seed, and reads its slice of each step's
global batch through `jaxfeed.Dataset.from_bucket_plan`.
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
