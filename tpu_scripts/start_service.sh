#!/usr/bin/env bash
# Starts the jaxfeed dispatcher on CPU VM 0 and one worker on each other CPU VM.
# Prints the dispatcher address to pass to the trainer (--service=...).
# The servers bind every interface, so they require credentials: a client
# token (trainers) and a worker token (workers), generated once into
# $SECRETS_DIR, copied to the VMs as 0600 files and passed by file (never on
# a command line, where `ps` shows it). run_trainer.sh ships the client token
# to the TPU hosts. Pipelines may use UDFs from jaxfeed, numpy and examples/.
source "$(dirname "$0")/common.sh"

ensure_tokens
dispatcher_vm="$CPU_VM_PREFIX-0"
dispatcher_ip=$(gcloud compute instances describe "$dispatcher_vm" --project="$PROJECT" \
  --zone="$ZONE" --format='get(networkInterfaces[0].networkIP)')
ship_secret_to_cpu_vm "$dispatcher_vm" "$SECRETS_DIR/client.token"
ship_secret_to_cpu_vm "$dispatcher_vm" "$SECRETS_DIR/worker.token"
# Servers bind every interface; each worker advertises its VM's internal IP.
cpu_ssh "$dispatcher_vm" "cd $REPO_DIR && nohup .venv/bin/python -m jaxfeed.service.dispatcher \
  --host=0.0.0.0 --port=$DISPATCHER_PORT --work_dir=\$HOME/jaxfeed_dispatcher \
  --auth_token_file=$REMOTE_SECRETS/client.token \
  --worker_token_file=$REMOTE_SECRETS/worker.token --udf_modules=examples. \
  > dispatcher.log 2>&1 &"
for i in $(seq 1 "$NUM_CPU_WORKERS"); do
  ship_secret_to_cpu_vm "$CPU_VM_PREFIX-$i" "$SECRETS_DIR/worker.token"
  cpu_ssh "$CPU_VM_PREFIX-$i" "cd $REPO_DIR && nohup .venv/bin/python -m jaxfeed.service.worker \
    --dispatcher_address=$dispatcher_ip:$DISPATCHER_PORT --host=0.0.0.0 \
    --advertise_host=\$(hostname -I | cut -d' ' -f1) --port=$WORKER_PORT \
    --worker_token_file=$REMOTE_SECRETS/worker.token --udf_modules=examples. \
    > worker.log 2>&1 &"
done
echo "$dispatcher_ip:$DISPATCHER_PORT"
