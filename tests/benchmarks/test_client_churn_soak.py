"""A short `benchmarks.client_churn_soak`: 8 threads of short reads for 6 s
in one client process (under `python -X dev`) end clean: no crash, no error,
no read stuck past twice its timeout."""

from __future__ import annotations

import pytest

from benchmarks import client_churn_soak

pytestmark = pytest.mark.timeout(180)


def test_eight_threads_of_short_reads_run_clean(tmp_path, capsys):
  code = client_churn_soak.main(
    [
      "--rounds=1",
      "--seconds=6",
      "--threads=8",
      "--workers=1",
      "--timeout_s=20",
      f"--log_dir={tmp_path}",
    ]
  )
  out = capsys.readouterr().out
  assert code == 0, out
  assert "1 of 1 rounds clean" in out
