"""The migration guides' tables (docs/migration/) stay complete and true.

Every row is `| peer name | jaxfeed name | same / differs / missing | notes |`.
The tables must name every public method of `tf.data.Dataset` and every
public name of `tf.data.experimental` in the pinned TensorFlow, everything
of `tf.data.experimental.service` (names, config fields, arguments,
`ShardingPolicy` members) and of Grain's `MapDataset`, `IterDataset` and
`DataLoader`; a row marked "same" or "differs" must name a jaxfeed
attribute that exists, and one marked "missing" one that does not (so a
new jaxfeed method makes its row wrong until the table says so).
"""

import dataclasses
import inspect
import pathlib
import re

import pytest

import jaxfeed

MIGRATION = pathlib.Path(__file__).resolve().parents[1] / "docs" / "migration"
STATUSES = ("same", "differs", "missing")
_ROW = re.compile(r"^\| `([^`]+)` \| `([^`]+)` \| (\w+) \|.*\|$")
# The Grain release the Grain guide was checked against (see pyproject.toml).
GRAIN_VERSION = "0.2.18"


@dataclasses.dataclass(frozen=True)
class Row:
  where: str
  peer: str
  jaxfeed: str
  status: str


def rows_of(page: str) -> list[Row]:
  """The table rows of a migration page, with a status column."""
  path = MIGRATION / page
  found = []
  for number, line in enumerate(path.read_text().splitlines(), start=1):
    match = _ROW.match(line)
    if match:
      found.append(Row(f"{page}:{number}", *match.groups()))
  return found


def jaxfeed_has(name: str) -> bool:
  """Whether the dotted `jaxfeed....` name exists (a dataclass field too)."""
  parts = name.split(".")
  assert parts[0] == "jaxfeed", name
  value = jaxfeed
  for i, part in enumerate(parts[1:], start=1):
    if (
      i == len(parts) - 1
      and dataclasses.is_dataclass(value)
      and part in {f.name for f in dataclasses.fields(value)}
    ):
      return True
    if not hasattr(value, part):
      return False
    value = getattr(value, part)
  return True


def peers(rows: list[Row], prefix: str) -> set[str]:
  """The names after `prefix` in the peer column (`Dataset.map` -> map)."""
  return {row.peer[len(prefix) :] for row in rows if row.peer.startswith(prefix)}


def public(names) -> set[str]:
  return {name for name in names if not name.startswith("_")}


@pytest.mark.parametrize("page", ["tf_data.md", "grain.md", "tf_data_service.md"])
def test_every_row_says_same_differs_or_missing_and_its_jaxfeed_name_agrees(page):
  rows = rows_of(page)
  assert len(rows) > 20, page
  wrong = []
  for row in rows:
    if row.status not in STATUSES:
      wrong.append(f"{row.where}: status {row.status!r} is none of {STATUSES}")
    elif (row.status == "missing") == jaxfeed_has(row.jaxfeed):
      wrong.append(
        f"{row.where}: {row.jaxfeed} is marked {row.status} but "
        f"{'exists' if jaxfeed_has(row.jaxfeed) else 'does not exist'}"
      )
  assert not wrong, "\n".join(wrong)


def test_jaxfeed_has_tells_a_missing_name_from_an_existing_one():
  assert jaxfeed_has("jaxfeed.Dataset.batch")
  assert jaxfeed_has("jaxfeed.service.WorkerConfig.dispatcher_address")
  assert not jaxfeed_has("jaxfeed.Dataset.no_such_method")
  assert not jaxfeed_has("jaxfeed.service.ShardingPolicy.NO_SUCH_POLICY")


def test_the_tf_data_tables_name_every_dataset_method_and_experimental_name():
  tf = pytest.importorskip("tensorflow")
  rows = rows_of("tf_data.md")
  assert peers(rows, "Dataset.") == public(dir(tf.data.Dataset))
  experimental = {row.peer for row in rows if "." not in row.peer}
  assert experimental == public(dir(tf.data.experimental))


def test_the_tf_data_service_table_names_everything_of_its_api():
  tf = pytest.importorskip("tensorflow")
  service = tf.data.experimental.service
  rows = rows_of("tf_data_service.md")
  assert {row.peer for row in rows if re.fullmatch(r"\w+", row.peer)} == public(dir(service))
  assert peers(rows, "ShardingPolicy.") == {m.name for m in service.ShardingPolicy}
  assert peers(rows, "DispatcherConfig.") == set(service.DispatcherConfig._fields)
  assert peers(rows, "WorkerConfig.") == set(service.WorkerConfig._fields)
  arguments = {row.peer for row in rows if "(" in row.peer}
  for function in (service.distribute, service.from_dataset_id, service.register_dataset):
    for parameter in inspect.signature(function).parameters:
      named = {f"{function.__name__}({parameter})", f"distribute({parameter})"}
      assert named & arguments, f"{function.__name__}({parameter}) has no row"


def test_the_grain_tables_name_every_method_of_its_datasets_and_loader():
  grain = pytest.importorskip("grain")
  if grain.__version__ != GRAIN_VERSION:
    pytest.skip(f"the Grain guide lists Grain {GRAIN_VERSION}, not {grain.__version__}")
  rows = rows_of("grain.md")
  for cls in (grain.MapDataset, grain.IterDataset):
    listed = {name for name in peers(rows, f"{cls.__name__}.") if not name.startswith("__")}
    assert listed == public(dir(cls)) | public(vars(type(cls))), cls.__name__
  loader_arguments = set(inspect.signature(grain.DataLoader).parameters)
  assert peers(rows, "DataLoader.") == loader_arguments | public(vars(grain.DataLoader))
  assert peers(rows, "DataLoaderIterator.") == public(dir(grain.DataLoaderIterator))
