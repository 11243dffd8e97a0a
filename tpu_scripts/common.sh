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
