"""The main job: the Flax trainer runs, learns, checkpoints and resumes."""

import os
import re
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_trainer(tmp_path, *flags, trainer="train_digits", smoke="digits_smoke", workdir="ckpt"):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", PYTHONPATH=REPO)
  cmd = [
    sys.executable,
    "-m",
    f"examples.{trainer}",
    f"--flagfile=configs/{smoke}.flags",
    f"--data_dir={tmp_path / 'data'}",
    f"--workdir={tmp_path / workdir}",
    *flags,
  ]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout


def losses(output):
  return [float(m) for m in re.findall(r"loss ([0-9.]+)", output)]


def logged_losses(output):
  """{step: the loss printed for it} of a trainer's log."""
  return {
    int(step): float(loss)
    for step, loss in re.findall(r"^step +([0-9]+)  loss ([0-9.]+)", output, re.M)
  }


def run_lm(tmp_path, *flags, workdir="ckpt"):
  return run_trainer(
    tmp_path,
    "--log_every=3",
    "--checkpoint_every=6",
    *flags,
    trainer="train_lm",
    smoke="lm_smoke",
    workdir=workdir,
  )


def test_lm_trainer_learns_and_resumes_exactly_where_it_stopped(tmp_path):
  straight = run_lm(tmp_path, "--num_steps=12", workdir="straight")
  assert "Training a 2-layer transformer on 8 devices (cpu)" in straight
  assert "code/prose 70/30" in straight
  values = logged_losses(straight)
  assert sorted(values) == [3, 6, 9, 12], straight
  assert values[12] < values[3] - 0.5, straight
  assert re.search(r"[0-9]+ tokens/s  input wait [0-9.]+% of step time", straight)
  # Stop at step 6, then resume: the same batches reach the same model, so the
  # losses after the restart are exactly those of the run that never stopped.
  run_lm(tmp_path, "--num_steps=6", workdir="stopped")
  resumed = run_lm(tmp_path, "--num_steps=12", "--resume", workdir="stopped")
  assert "Resumed from step 6 (loader at batch 6)" in resumed
  after = logged_losses(resumed)
  assert after == {9: values[9], 12: values[12]}, (straight, resumed)


def test_trainer_learns_checkpoints_and_resumes(tmp_path):
  first = run_trainer(tmp_path, "--num_steps=20", "--log_every=5", "--checkpoint_every=20")
  assert "Training on 8 devices (cpu)" in first
  values = losses(first)
  assert len(values) == 4 and values[-1] < values[0], first
  assert re.search(r"input wait [0-9.]+% of step time", first)
  assert "Done at step 20" in first
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["20"]

  resumed = run_trainer(
    tmp_path, "--num_steps=30", "--resume", "--log_every=5", "--checkpoint_every=10"
  )
  assert "Resumed from step 20 (loader at batch 20)" in resumed
  steps = [int(s) for s in re.findall(r"^step +([0-9]+)", resumed, re.M)]
  assert steps == [25, 30], resumed
  assert "Done at step 30" in resumed
  # The restored model continues from the trained weights, not from scratch.
  assert losses(resumed)[0] < values[0] - 0.3, (first, resumed)


def test_trainer_reads_through_the_service_and_resumes_the_model_and_the_read(tmp_path):
  env = dict(os.environ, PYTHONPATH=REPO, GRPC_VERBOSITY="ERROR", JAX_PLATFORMS="cpu")

  def start(*args):
    proc = subprocess.Popen(
      [sys.executable, "-m", *args],
      cwd=REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.DEVNULL,
      text=True,
    )
    words = proc.stdout.readline().split()
    return proc, words[words.index("on") + 1]

  # The trainer's UDFs live in examples/.
  dispatcher, address = start("jaxfeed.service.dispatcher", "--port=0", "--udf_modules=examples.")
  worker, _ = start(
    "jaxfeed.service.worker", f"--dispatcher_address={address}", "--udf_modules=examples."
  )
  try:
    first = run_trainer(
      tmp_path, f"--service={address}", "--num_steps=20", "--log_every=5", "--checkpoint_every=20"
    )
    values = losses(first)
    assert len(values) == 4 and values[-1] < values[0], first
    assert "Done at step 20" in first
    resumed = run_trainer(
      tmp_path, f"--service={address}", "--num_steps=30", "--resume", "--log_every=5"
    )
    # The model comes back, and the service read goes on after batch 20.
    assert "Resumed from step 20 (loader at batch 20)" in resumed
    steps = [int(s) for s in re.findall(r"^step +([0-9]+)", resumed, re.M)]
    assert steps == [25, 30], resumed
    assert losses(resumed)[0] < values[0] - 0.3, (first, resumed)
  finally:
    for proc in (worker, dispatcher):
      proc.terminate()
      proc.wait(timeout=60)


def run_images(tmp_path, *flags, workdir="ckpt"):
  return run_trainer(
    tmp_path,
    "--log_every=3",
    "--checkpoint_every=6",
    *flags,
    trainer="train_images",
    smoke="images_smoke",
    workdir=workdir,
  )


def test_image_trainer_learns_and_resumes_exactly_where_it_stopped(tmp_path):
  straight = run_images(tmp_path, "--num_steps=12", workdir="straight")
  assert "Training a CNN on 8 devices (cpu)" in straight
  assert "256 JPEG Examples, 4 classes" in straight
  values = logged_losses(straight)
  assert sorted(values) == [3, 6, 9, 12], straight
  assert values[12] < values[3], straight
  assert re.search(r"[0-9]+ images/s  input wait [0-9.]+% of step time", straight)
  assert sorted(os.listdir(tmp_path / "straight")) == ["12", "6"]
  # Drop the last checkpoint and resume from step 6: the same batches reach
  # the same model, so the losses are exactly those of the straight run.
  shutil.rmtree(tmp_path / "straight" / "12")
  resumed = run_images(tmp_path, "--num_steps=12", "--resume", workdir="straight")
  assert "Resumed from step 6 (loader at batch 6)" in resumed
  assert logged_losses(resumed) == {9: values[9], 12: values[12]}, (straight, resumed)
