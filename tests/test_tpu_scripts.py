"""The Cloud TPU VM scripts parse, and pass the servers only flags they define."""

from __future__ import annotations

import json
import pathlib
import re
import stat
import subprocess
import sys

import pytest

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "tpu_scripts"


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.sh")))
def test_script_parses(script):
  subprocess.run(["bash", "-n", str(SCRIPTS / script)], check=True)


def _defined_flags(role: str) -> set[str]:
  code = (
    f"import json; from absl import flags; from jaxfeed.service.{role} import server; "
    f"server.define_flags(); print(json.dumps(sorted(flags.FLAGS)))"
  )
  out = subprocess.run(
    [sys.executable, "-c", code], check=True, capture_output=True, text=True
  ).stdout
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


def test_servers_get_their_tokens_by_file_never_on_a_command_line():
  text = (SCRIPTS / "start_service.sh").read_text().replace("\\\n", " ")
  (dispatcher,) = re.findall(r"jaxfeed\.service\.dispatcher\b([^>]*)>", text)
  workers = re.findall(r"jaxfeed\.service\.worker\b([^>]*)>", text)
  assert "--auth_token_file=" in dispatcher and "--worker_token_file=" in dispatcher
  assert all("--worker_token_file=" in w and "--auth_token_file" not in w for w in workers)
  for script in SCRIPTS.glob("*.sh"):
    assert not re.search(r"--(auth_token|worker_token|pickled_udf_secret)=", script.read_text()), (
      script.name
    )


def test_tokens_are_made_once_readable_by_this_user_only(tmp_path):
  folder = tmp_path / "secrets"
  env = {
    "PATH": "/usr/bin:/bin",
    "HOME": str(tmp_path),
    "PROJECT": "test",
    "SECRETS_DIR": str(folder),
  }
  make = f"source {SCRIPTS / 'common.sh'} && ensure_tokens"
  subprocess.run(["bash", "-c", make], check=True, env=env)
  tokens = {name: (folder / f"{name}.token").read_text().strip() for name in ("client", "worker")}
  assert len(tokens["client"]) == 64 and tokens["client"] != tokens["worker"]
  assert stat.S_IMODE(folder.stat().st_mode) == 0o700
  for name in tokens:
    assert stat.S_IMODE((folder / f"{name}.token").stat().st_mode) == 0o600
  subprocess.run(["bash", "-c", make], check=True, env=env)  # kept, not remade
  assert (folder / "client.token").read_text().strip() == tokens["client"]
