"""Random-access record sources (the leftmost layer): in-memory arrays,
array_record files and TFRecord files, plus writers for both file formats.

Every source follows `RecordSource`: `len(src)`, `src[i]`,
`src.get_many(indices)`, `close()`, picklable, `spec_params()`.
"""

from jaxfeed.sources.array_record_source import ArrayRecordSource, write_array_record
from jaxfeed.sources.array_source import ArraySource
from jaxfeed.sources.base import CorruptRecordError, RecordSource
from jaxfeed.sources.concat_source import ConcatSource
from jaxfeed.sources.tfrecord_format import write_tfrecord
from jaxfeed.sources.tfrecord_scan import DamagedRange
from jaxfeed.sources.tfrecord_source import TFRecordSource

__all__ = [
  "ArrayRecordSource",
  "ArraySource",
  "ConcatSource",
  "CorruptRecordError",
  "DamagedRange",
  "RecordSource",
  "TFRecordSource",
  "write_array_record",
  "write_tfrecord",
]
