"""The Cloud TPU VM scripts parse, and pass the servers only flags they define."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "tpu_scripts"


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.sh")))
def test_script_parses(script):
  subprocess.run(["bash", "-n", str(SCRIPTS / script)], check=True)


def _defined_flags(role: str) -> set[str]:
  code = (f"import json; from absl import flags; from jaxfeed.service import {role}; "
          f"{role}.define_flags(); print(json.dumps(sorted(flags.FLAGS)))")
  out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                       text=True).stdout
  return set(json.loads(out))


@pytest.mark.parametrize("role", ["dispatcher", "worker"])
def test_service_commands_use_real_flags_and_reach_other_machines(role):
  text = (SCRIPTS / "start_service.sh").read_text().replace("\\\n", " ")
  commands = re.findall(rf"jaxfeed\.service\.{role}\b([^>]*)>", text)
  assert commands, f"start_service.sh starts no {role}"
  defined = _defined_flags(role)
  for command in commands:
    used = re.findall(r"--([a-z_]+)=", command)
    assert set(used) <= defined, set(used) - defined
    assert "--host=0.0.0.0" in command  # 127.0.0.1 is unreachable from other VMs
