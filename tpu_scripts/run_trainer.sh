#!/usr/bin/env bash
# Runs the example trainer on every host of the TPU slice (one JAX process per
# host; jax.distributed finds its peers through the TPU metadata).
# Extra arguments are passed to the trainer, e.g. --num_steps=10000, or
# --service=<address printed by start_service.sh> to preprocess on the CPU VMs
# (they need the same --data_dir files).
source "$(dirname "$0")/common.sh"

tpu_ssh "cd $REPO_DIR && python3 -m examples.train_digits \
  --flagfile=configs/digits.flags --distributed \
  --data_dir=\$HOME/jaxfeed_digits/data --workdir=\$HOME/jaxfeed_digits/ckpt $*"
