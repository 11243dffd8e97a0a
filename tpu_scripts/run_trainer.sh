#!/usr/bin/env bash
# Runs the example trainer on every host of the TPU slice (one JAX process per
# host; jax.distributed finds its peers through the TPU metadata).
# Extra arguments are passed to the trainer, e.g. --num_steps=10000, or
# --service=<address printed by start_service.sh> to preprocess on the CPU VMs
# (they need the same --data_dir files); the service's client token then goes
# to the TPU hosts as a 0600 file and the trainer reads it from there.
source "$(dirname "$0")/common.sh"

token_flag=""
if [[ " $* " == *" --service="* ]]; then
  ensure_tokens
  ship_secret_to_tpu "$SECRETS_DIR/client.token"
  token_flag="--service_token_file=$REMOTE_SECRETS/client.token"
fi
tpu_ssh "cd $REPO_DIR && python3 -m examples.train_digits \
  --flagfile=configs/digits.flags --distributed \
  --data_dir=\$HOME/jaxfeed_digits/data --workdir=\$HOME/jaxfeed_digits/ckpt $token_flag $*"
