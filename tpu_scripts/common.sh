#!/usr/bin/env bash
# Settings shared by the Cloud TPU VM scripts. Override any of them in the
# environment before calling a script.
set -euo pipefail
: "${PROJECT:?set PROJECT to your Google Cloud project}"
: "${ZONE:=us-central2-b}"
: "${TPU_NAME:=jaxfeed-trainer}"
: "${ACCELERATOR_TYPE:=v4-32}"
: "${RUNTIME_VERSION:=tpu-ubuntu2204-base}"
: "${CPU_VM_PREFIX:=jaxfeed-cpu}"
: "${CPU_MACHINE_TYPE:=n2-standard-32}"
: "${NUM_CPU_WORKERS:=4}"
: "${DISPATCHER_PORT:=5050}"
: "${WORKER_PORT:=5051}"
: "${REPO_DIR:=jaxfeed}"
export PROJECT ZONE TPU_NAME ACCELERATOR_TYPE RUNTIME_VERSION CPU_VM_PREFIX \
  CPU_MACHINE_TYPE NUM_CPU_WORKERS DISPATCHER_PORT WORKER_PORT REPO_DIR

tpu_ssh() {  # tpu_ssh <command>: runs a command on every host of the slice.
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" \
    --worker=all --command="$1"
}

cpu_ssh() {  # cpu_ssh <vm> <command>
  gcloud compute ssh "$1" --project="$PROJECT" --zone="$ZONE" --command="$2"
}

# Service credentials: a client token (trainers) and a worker token (workers),
# made once per deployment, kept in a folder only this user can read.
: "${SECRETS_DIR:=$HOME/.jaxfeed/$TPU_NAME}"
export SECRETS_DIR
REMOTE_SECRETS='$HOME/.jaxfeed'  # on the VMs, expanded there

ensure_tokens() {  # ensure_tokens: creates client.token and worker.token if missing.
  (umask 077 && mkdir -p "$SECRETS_DIR")
  chmod 700 "$SECRETS_DIR"
  local name
  for name in client worker; do
    if [[ ! -s "$SECRETS_DIR/$name.token" ]]; then
      (umask 077 && python3 -c 'import secrets; print(secrets.token_hex(32))' \
        > "$SECRETS_DIR/$name.token")
    fi
    chmod 600 "$SECRETS_DIR/$name.token"
  done
}

ship_secret_to_cpu_vm() {  # ship_secret_to_cpu_vm <vm> <file>: a 0600 copy in ~/.jaxfeed.
  cpu_ssh "$1" "mkdir -p -m 700 $REMOTE_SECRETS"
  gcloud compute scp "$2" "$1:.jaxfeed/" --project="$PROJECT" --zone="$ZONE"
  cpu_ssh "$1" "chmod 600 $REMOTE_SECRETS/$(basename "$2")"
}

ship_secret_to_tpu() {  # ship_secret_to_tpu <file>: to every host of the slice.
  tpu_ssh "mkdir -p -m 700 $REMOTE_SECRETS"
  gcloud compute tpus tpu-vm scp "$1" "$TPU_NAME":.jaxfeed/ --project="$PROJECT" \
    --zone="$ZONE" --worker=all
  tpu_ssh "chmod 600 $REMOTE_SECRETS/$(basename "$1")"
}
