#!/usr/bin/env bash
# Deletes the TPU slice and the CPU VMs created by create_slice.sh.
source "$(dirname "$0")/common.sh"

gcloud compute tpus tpu-vm delete "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" --quiet
for i in $(seq 0 "$NUM_CPU_WORKERS"); do
  gcloud compute instances delete "$CPU_VM_PREFIX-$i" --project="$PROJECT" --zone="$ZONE" --quiet
done
