"""The dispatcher shares a dataset only between pipelines that compute the same.

Dispatcher and worker run as separate processes: the dispatcher computes each
fingerprint from the spec it receives, workers check the code of import-path
UDFs and key their autocache by the rebuilt pipeline's fingerprint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

import jaxfeed
import service_udfs
from jaxfeed import service
from jaxfeed.service.protocol import spec
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.worker import task_pipeline
from service_cluster import REPO_ROOT, TESTS_DIR, TEST_UDF_MODULES

pytestmark = pytest.mark.timeout(120)

SECRET = "fingerprint-test-secret"
HEARTBEAT = "--heartbeat_interval_s=0.2"


def start(cluster, *worker_flags: str, extra_udf_modules: tuple = ()):
  allowed = [f"--udf_modules={','.join((*TEST_UDF_MODULES, *extra_udf_modules))}"]
  dispatcher = cluster("dispatcher", "--port=0", f"--pickled_udf_secret={SECRET}", *allowed)
  cluster(
    "worker",
    f"--dispatcher_address={dispatcher.address}",
    HEARTBEAT,
    f"--pickled_udf_secret={SECRET}",
    *allowed,
    *worker_flags,
  )
  return dispatcher


def values(dataset) -> list:
  with dataset.make_iterator() as iterator:
    return [np.asarray(element).tolist() for element in iterator]


def make(k):
  return lambda x: x * k


def test_closures_of_one_factory_are_two_datasets(cluster):
  dispatcher = start(cluster)
  outputs = [
    values(
      jaxfeed.Dataset.range(4)
      .map(make(k))
      .distribute(dispatcher.address, "parallel_epochs", udf_secret=SECRET.encode())
    )
    for k in (2, 3)
  ]
  assert outputs == [[0, 2, 4, 6], [0, 3, 6, 9]]


def test_closures_of_one_factory_do_not_share_a_stream(cluster):
  dispatcher = start(cluster)
  readers = [
    jaxfeed.Dataset.range(4)
    .map(make(k))
    .distribute(
      dispatcher.address, "parallel_epochs", udf_secret=SECRET.encode(), ephemeral_sharing=True
    )
    .make_iterator()
    for k in (2, 3)
  ]
  try:
    outputs = [[], []]
    for _ in range(4):  # in turns, so that both jobs run at once
      for reader, output in zip(readers, outputs):
        output.append(int(next(reader)))
  finally:
    for reader in readers:
      reader.close()
  assert outputs == [[0, 2, 4, 6], [0, 3, 6, 9]]


def register_raw(address: str, dataset_def: pb.DatasetDef) -> str:
  with grpc.insecure_channel(address) as channel:
    call = channel.unary_unary(
      "/jaxfeed.service.Dispatcher/RegisterDataset",
      request_serializer=lambda m: m.SerializeToString(),
      response_deserializer=pb.RegisterDatasetResponse.FromString,
    )
    return call(pb.RegisterDatasetRequest(dataset=dataset_def), timeout=30).dataset_id


def test_a_forged_fingerprint_from_the_client_is_ignored(cluster):
  dispatcher = start(cluster)
  plus_one = jaxfeed.Dataset.range(4).map(service_udfs.add_one)
  plain = jaxfeed.Dataset.range(4)
  first = spec.to_dataset_def(plus_one.node)
  victim = first.fingerprint
  forged = spec.to_dataset_def(plain.node)
  forged.fingerprint = victim  # claims to be the first pipeline
  first_id = register_raw(dispatcher.address, first)
  forged_id = register_raw(dispatcher.address, forged)
  assert forged_id != first_id
  blank = spec.to_dataset_def(plain.node)
  blank.fingerprint = "forged"
  assert register_raw(dispatcher.address, blank) == forged_id  # equal content: shared
  read = lambda dataset_id: values(
    service.from_dataset_id("parallel_epochs", dispatcher.address, dataset_id)
  )
  assert read(first_id) == [1, 2, 3, 4]
  assert read(forged_id) == [0, 1, 2, 3]


def write_labelled(path: str, xs) -> None:
  jaxfeed.write_tfrecord(path, [np.int32(7).tobytes() + np.int64(x).tobytes() for x in xs])


def wait_for_cache_entries(cache_dir: str, count: int) -> list[str]:
  deadline = time.monotonic() + 60
  while True:
    # A whole pass has its manifest; records kept by index, their blocks.
    done = sorted(
      name
      for name in os.listdir(cache_dir)
      if os.path.exists(os.path.join(cache_dir, name, "manifest.json"))
      or any(f.startswith("block-") for f in os.listdir(os.path.join(cache_dir, name)))
    )
    if len(done) >= count or time.monotonic() > deadline:
      return done
    time.sleep(0.05)


def test_autocache_serves_a_file_rewritten_at_the_same_path(cluster, tmp_path):
  cache_dir = tmp_path / "autocache"
  cache_dir.mkdir()
  dispatcher = start(cluster, f"--autocache_dir={cache_dir}", "--autocache_policy=always")
  path = str(tmp_path / "labelled.tfrecord")

  def read_file() -> list:
    dataset = (
      jaxfeed.Dataset.from_source(jaxfeed.TFRecordSource(path))
      .map(service_udfs.decode_record)
      .autocache()
      .map(lambda e: e["x"])
    )
    return values(
      dataset.distribute(dispatcher.address, "parallel_epochs", udf_secret=SECRET.encode())
    )

  write_labelled(path, range(4))
  stat = os.stat(path)
  assert read_file() == [0, 1, 2, 3]
  assert len(wait_for_cache_entries(str(cache_dir), 1)) == 1
  assert read_file() == [0, 1, 2, 3]  # the same file: the same cache entry
  write_labelled(path, range(10, 14))  # as many records, as many bytes
  # Where the filesystem clock is coarse the rewrite may keep the mtime.
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
  assert read_file() == [10, 11, 12, 13]
  assert len(wait_for_cache_entries(str(cache_dir), 2)) == 2


VERSIONED_MODULE = "fingerprint_versioned_udf"


def write_module(directory, body: str) -> None:
  directory.mkdir()
  (directory / f"{VERSIONED_MODULE}.py").write_text(f"def scale(x):\n  return {body}\n")


def test_worker_refuses_an_import_path_udf_whose_code_differs(cluster, tmp_path, monkeypatch):
  write_module(tmp_path / "client", "x * 2")
  write_module(tmp_path / "worker", "x * 3")
  monkeypatch.setenv(
    "PYTHONPATH", os.pathsep.join([str(tmp_path / "worker"), os.environ.get("PYTHONPATH", "")])
  )
  dispatcher = start(cluster, extra_udf_modules=(VERSIONED_MODULE,))
  monkeypatch.syspath_prepend(str(tmp_path / "client"))
  monkeypatch.delitem(sys.modules, VERSIONED_MODULE, raising=False)
  module = __import__(VERSIONED_MODULE)
  try:
    dataset = jaxfeed.Dataset.range(4).map(module.scale)
    with pytest.raises(service.ServiceError) as info:
      values(dataset.distribute(dispatcher.address, "parallel_epochs"))
  finally:
    sys.modules.pop(VERSIONED_MODULE, None)
  message = str(info.value)
  assert "FAILED_PRECONDITION" in message
  assert f"{VERSIONED_MODULE}:scale" in message
  assert (f"client and worker run different versions of module '{VERSIONED_MODULE}'") in message


def decoded_with_udf(edit) -> None:
  dataset_def = spec.to_dataset_def(jaxfeed.Dataset.range(4).map(service_udfs.add_one).node)
  graph = json.loads(dataset_def.graph_json)
  fn = graph["params"]["fn"]  # the root is the map
  fn["__callable__"] = edit(fn["__callable__"])
  dataset_def.graph_json = json.dumps(graph).encode()
  spec.from_dataset_def(dataset_def)


def test_an_import_path_udf_carries_the_hash_of_its_code():
  decoded_with_udf(lambda body: body)  # unchanged: rebuilds
  with pytest.raises(
    spec.UDFImportError, match="service_udfs:add_one.*different versions of module 'service_udfs'"
  ):
    decoded_with_udf(lambda body: {**body, "code": "0" * 64})
  with pytest.raises(spec.UDFImportError, match="service_udfs:add_one.*without the hash"):
    decoded_with_udf(lambda body: body["path"])


def test_the_spec_fingerprint_covers_every_part_of_the_spec():
  dataset_def = spec.to_dataset_def(
    jaxfeed.Dataset.from_tensor_slices(np.arange(6)).map(service_udfs.add_one).node
  )
  original = spec.fingerprint(dataset_def)
  variants = []
  for field, value in [
    ("graph_json", dataset_def.graph_json + b" "),
    ("arrays", dataset_def.arrays[:-1] + b"\x01"),
    ("num_positions", 7),
    ("fingerprint", "claimed"),
    ("signature", b"sig"),
  ]:
    changed = pb.DatasetDef()
    changed.CopyFrom(dataset_def)
    setattr(changed, field, value)
    variants.append(spec.fingerprint(changed))
  pickled = pb.DatasetDef()
  pickled.CopyFrom(dataset_def)
  pickled.pickled_udfs.append(b"udf")
  variants.append(spec.fingerprint(pickled))
  # Neither the claimed fingerprint nor the signature says what is computed.
  assert variants[3:5] == [original, original]
  assert len({original, *variants[:3], variants[5]}) == 5


OPTION_VARIANTS = [
  None,
  jaxfeed.Options(),
  jaxfeed.Options(stats=False),
  jaxfeed.Options(optimize=False, autotune=False, inject_prefetch=True, autotune_cpu_budget=1),
]


def with_options(dataset, options):
  return dataset if options is None else dataset.with_options(options)


def test_options_are_no_part_of_the_spec_fingerprint():
  dataset = jaxfeed.Dataset.range(8).map(service_udfs.add_one).batch(2)
  defs = [
    spec.to_dataset_def(task_pipeline.pipeline_node(with_options(dataset, o), "distribute"))
    for o in OPTION_VARIANTS
  ]
  assert len({d.graph_json for d in defs}) == len(OPTION_VARIANTS)  # each ships its own
  assert len({spec.fingerprint(d) for d in defs}) == 1
  other = spec.to_dataset_def(
    task_pipeline.pipeline_node(
      jaxfeed.Dataset.range(8)
      .map(service_udfs.add_one)
      .batch(4)
      .with_options(jaxfeed.Options(stats=False)),
      "distribute",
    )
  )
  assert spec.fingerprint(other) != spec.fingerprint(defs[0])
  with service.DispatchServer() as dispatcher:
    ids = {dispatcher.state.register_dataset(d) for d in defs}
    assert len(ids) == 1  # one dataset, run with the Options registered first
    assert dispatcher.state.dataset_def(ids.pop()).graph_json == defs[0].graph_json


def test_consumers_whose_pipelines_differ_only_in_options_share_one_job(cluster):
  dispatcher = start(cluster)
  dataset = jaxfeed.Dataset.range(40).map(service_udfs.add_one)
  readers = [
    with_options(dataset, o)
    .distribute(dispatcher.address, "distributed_epoch", job_name="shared")
    .make_iterator()
    for o in OPTION_VARIANTS
  ]
  got = []
  try:
    while readers:  # in turns, so that every consumer joins the job at once
      for reader in list(readers):
        try:
          got.append(int(next(reader)))
        except StopIteration:
          reader.close()
          readers.remove(reader)
  finally:
    for reader in readers:
      reader.close()
  # One job: every element once over all consumers.
  assert sorted(got) == list(range(1, 41))


SPEC_SCRIPT = """
import numpy as np
import jaxfeed
import service_udfs
from jaxfeed.service.protocol import spec
source = jaxfeed.ArraySource({"x": np.arange(50), "y": np.linspace(0, 1, 50)})
dataset = jaxfeed.Dataset.from_source(
    source, jaxfeed.IndexSampler(50, shuffle=True, seed=3)
).map(service_udfs.add_one_to_x).batch(4)
FINGERPRINT = spec.fingerprint(spec.to_dataset_def(dataset.node))
"""


def test_the_same_pipeline_has_the_same_spec_fingerprint_in_other_processes():
  expected = {}
  exec(SPEC_SCRIPT, expected)  # pylint: disable=exec-used
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), env.get("PYTHONPATH", "")])
  env["JAX_PLATFORMS"] = "cpu"
  printed = subprocess.run(
    [sys.executable, "-c", SPEC_SCRIPT + "print(FINGERPRINT)"],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  ).stdout.strip()
  assert printed == expected["FINGERPRINT"]


@pytest.mark.parametrize(
  "old_path,new_path",
  [
    (
      "jaxfeed.service.task_pipeline:WithOptionsNode",
      "jaxfeed.service.worker.task_pipeline:WithOptionsNode",
    ),
    ("jaxfeed.service.client:DistributedNode", "jaxfeed.service.client.distribute:DistributedNode"),
  ],
)
def test_a_spec_naming_a_service_node_by_its_path_before_the_move_rebuilds_the_same(
  old_path, new_path
):
  # A dispatcher's journal keeps the specs clients registered, written with
  # the class paths the service's nodes had before its modules moved into
  # folders; a restarted dispatcher hands them to workers as they are.
  dataset = jaxfeed.Dataset.range(8).map(service_udfs.add_one).batch(4)
  if "DistributedNode" in old_path:
    dataset = dataset.distribute("127.0.0.1:1")
  node = task_pipeline.pipeline_node(
    dataset.with_options(jaxfeed.Options(stats=False)), "distribute"
  )
  current = spec.to_dataset_def(node)
  assert new_path.encode() in current.graph_json
  written_before = pb.DatasetDef()
  written_before.CopyFrom(current)
  written_before.graph_json = current.graph_json.replace(new_path.encode(), old_path.encode())
  rebuilt = spec.from_dataset_def(written_before)
  assert spec.to_dataset_def(rebuilt).graph_json == current.graph_json
  if "WithOptionsNode" in old_path:  # left out of the hash: new clients share it
    assert spec.fingerprint(written_before) == spec.fingerprint(current)


def test_jobs_with_other_samplers_share_the_workers_preprocessing(cluster, tmp_path, monkeypatch):
  # OneAccess's sweep: jobs differ in sampling only. Over from_source and
  # per-record ops, autocache keeps the results by record index: each record
  # is preprocessed once across the jobs, a distributed_epoch job's splits
  # included, and each job reads exactly its own pipeline's elements.
  calls = tmp_path / "calls"
  monkeypatch.setenv("JAXFEED_TEST_CALLS", str(calls))
  dispatcher = start(
    cluster, f"--autocache_dir={tmp_path / 'autocache'}", "--autocache_policy=always"
  )
  source = jaxfeed.ArraySource({"x": np.arange(500)})

  def dataset(seed):
    sampler = jaxfeed.IndexSampler(500, shuffle=True, seed=seed)
    return (
      jaxfeed.Dataset.from_source(source, sampler)
      .map(service_udfs.logged_triple)
      .autocache()
      .map(lambda e: e["x"])
    )

  def local(seed):
    sampler = jaxfeed.IndexSampler(500, shuffle=True, seed=seed)
    return [3 * m.record_index for m in sampler]

  first = values(
    dataset(0).distribute(dispatcher.address, "parallel_epochs", udf_secret=SECRET.encode())
  )
  assert first == local(0)
  assert calls.stat().st_size == 500
  second = values(
    dataset(1).distribute(dispatcher.address, "parallel_epochs", udf_secret=SECRET.encode())
  )
  assert second == local(1)
  split = values(
    dataset(2).distribute(dispatcher.address, "distributed_epoch", udf_secret=SECRET.encode())
  )
  assert sorted(split) == sorted(local(2))
  assert calls.stat().st_size == 500  # the later jobs preprocessed nothing
