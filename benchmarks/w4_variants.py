"""W4 / W4t through the jaxfeed service's other paths, in one run.

  python -m benchmarks.w4_variants [--epochs=3] [--scale=1.0] [--workers=1]
                                   [--only=W4 | --only=W4t]

W4t (MB/s of ready 128x56x56x3 float32 batches, as in w4_service) over the raw
data socket and over gRPC streams, each without and with TLS (the test
certificates of tests/service/tls); and W4 (images/s) with at-most-once and
exactly-once visitation. Prints one JSON line per variant with its ratio to
the plain socket path (W4t) or to at-most-once (W4) measured in the same run.
"""

from __future__ import annotations

import os
import sys
import tempfile

from benchmarks import harness
from benchmarks import record
from benchmarks import w4_service
from benchmarks import workloads

TLS_DIR = str(w4_service.REPO_ROOT / "tests" / "service" / "tls")


def _cluster(num_workers: int, tls: bool, split_size: int) -> tuple[list, str]:
  flags, worker_flags = [], []
  if tls:
    flags = [f"--tls_key={TLS_DIR}/server.key", f"--tls_cert={TLS_DIR}/server.pem"]
    worker_flags = [f"--tls_root_certs={TLS_DIR}/ca.pem"]
  procs, address, _ = w4_service.jaxfeed_cluster(num_workers, split_size, flags, worker_flags)
  return procs, address


_MEMORY_AND_START = ("first_batch_ms", "peak_rss_mb", "servers_peak_rss_mb", "total_peak_rss_mb")


def _measure(make, address: str, epochs: int, procs: list, **options) -> dict:
  def epoch():
    return (
      make()
      .distribute(address, "distributed_epoch", max_outstanding_requests=8, **options)
      .make_iterator()
    )

  result = harness.measure(epoch, lambda b: len(b["image"]), epochs, servers=[p.pid for p in procs])
  result["memory_and_start"] = {k: result[k] for k in _MEMORY_AND_START}
  return result


def _w4_visitations(data: dict, workers: int, epochs: int) -> list[dict]:
  import jaxfeed  # pylint: disable=g-import-not-at-top

  n = len(data["label"])
  w4 = []
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "w4.tfrecord")
    jaxfeed.write_tfrecord(
      path, [data["label"][i].tobytes() + data["image"][i].tobytes() for i in range(n)]
    )
    procs, address = _cluster(workers, False, w4_service.W4_SPLIT_SIZE)
    try:
      for visitation in ("at_most_once", "exactly_once"):
        result = _measure(
          lambda: w4_service._jaxfeed_w4(path, n),  # pylint: disable=protected-access
          address,
          epochs,
          procs,
          visitation=visitation,
        )
        w4.append(
          {
            "workload": "W4",
            "unit": "images/s",
            "workers": workers,
            "visitation": visitation,
            "rate": round(result["rate"], 1),
            "rates": result["rates"],
            "items": result["items"],
            **result["memory_and_start"],
          }
        )
    finally:
      harness.stop_processes(procs)
  return w4


def main(argv: list[str]) -> None:
  args = dict(a.lstrip("-").split("=", 1) for a in argv[1:] if "=" in a)
  epochs, scale = int(args.get("epochs", 3)), float(args.get("scale", 1.0))
  workers = int(args.get("workers", 1))
  only = args.get("only", "")
  from jaxfeed import service  # pylint: disable=g-import-not-at-top

  data = workloads.w1_data(scale)
  n = len(data["label"])
  image_bytes = workloads.CROP * workloads.CROP * 3 * 4
  with open(os.path.join(TLS_DIR, "ca.pem"), "rb") as f:
    tls = service.TLSConfig(root_certificates=f.read())
  lines, w4 = [], []
  for use_tls in (False, True) if only != "W4" else ():
    procs, address = _cluster(workers, use_tls, w4_service.W4T_SPLIT_SIZE)
    try:
      for transfer in ("socket", "grpc"):
        result = _measure(
          lambda: w4_service._jaxfeed_w4t(n),  # pylint: disable=protected-access
          address,
          epochs,
          procs,
          data_transfer=transfer,
          tls=tls if use_tls else None,
        )
        lines.append(
          {
            "workload": "W4t",
            "unit": "MB/s",
            "workers": workers,
            "path": f"{transfer}{' + TLS' if use_tls else ''}",
            "rate": round(result["rate"] * image_bytes / 1e6, 1),
            "rates": [round(r * image_bytes / 1e6, 1) for r in result["rates"]],
            **result["memory_and_start"],
          }
        )
    finally:
      harness.stop_processes(procs)
  for line in lines:
    line["ratio_vs_socket"] = round(line["rate"] / lines[0]["rate"], 3)
  if only != "W4t":
    w4 = _w4_visitations(data, workers, epochs)
  for line in w4:
    line["ratio_vs_at_most_once"] = round(line["rate"] / w4[0]["rate"], 3)
  for line in lines + w4:
    record.row(line)


if __name__ == "__main__":
  with record.run("w4_variants"):
    main(sys.argv)
