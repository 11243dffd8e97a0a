#!/usr/bin/env bash
# Creates the TPU VM slice and the CPU VMs for the jaxfeed service, then
# installs jaxfeed on all of them from a copy of this repository.
source "$(dirname "$0")/common.sh"

gcloud compute tpus tpu-vm create "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" \
  --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION"
for i in $(seq 0 "$NUM_CPU_WORKERS"); do
  gcloud compute instances create "$CPU_VM_PREFIX-$i" --project="$PROJECT" \
    --zone="$ZONE" --machine-type="$CPU_MACHINE_TYPE" \
    --image-family=debian-12 --image-project=debian-cloud
done

archive=$(mktemp -d)/jaxfeed.tar.gz
git -C "$(dirname "$0")/.." archive --format=tar.gz -o "$archive" HEAD
gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME":jaxfeed.tar.gz \
  --project="$PROJECT" --zone="$ZONE" --worker=all
tpu_ssh "mkdir -p $REPO_DIR && tar xzf jaxfeed.tar.gz -C $REPO_DIR && \
  cd $REPO_DIR && python3 -m pip install -q -e '.[examples]' 'jax[tpu]'"
for i in $(seq 0 "$NUM_CPU_WORKERS"); do
  gcloud compute scp "$archive" "$CPU_VM_PREFIX-$i":jaxfeed.tar.gz --project="$PROJECT" --zone="$ZONE"
  cpu_ssh "$CPU_VM_PREFIX-$i" "mkdir -p $REPO_DIR && tar xzf jaxfeed.tar.gz -C $REPO_DIR && \
    cd $REPO_DIR && python3 -m venv .venv && .venv/bin/pip install -q -e '.[compression]'"
done
