#!/usr/bin/env bash
# Starts the jaxfeed dispatcher on CPU VM 0 and one worker on each other CPU VM.
# Prints the dispatcher address to pass to the trainer (--service=...).
source "$(dirname "$0")/common.sh"

dispatcher_vm="$CPU_VM_PREFIX-0"
dispatcher_ip=$(gcloud compute instances describe "$dispatcher_vm" --project="$PROJECT" \
  --zone="$ZONE" --format='get(networkInterfaces[0].networkIP)')
# Servers bind every interface; each worker advertises its VM's internal IP.
cpu_ssh "$dispatcher_vm" "cd $REPO_DIR && nohup .venv/bin/python -m jaxfeed.service.dispatcher \
  --host=0.0.0.0 --port=$DISPATCHER_PORT --work_dir=\$HOME/jaxfeed_dispatcher \
  > dispatcher.log 2>&1 &"
for i in $(seq 1 "$NUM_CPU_WORKERS"); do
  cpu_ssh "$CPU_VM_PREFIX-$i" "cd $REPO_DIR && nohup .venv/bin/python -m jaxfeed.service.worker \
    --dispatcher_address=$dispatcher_ip:$DISPATCHER_PORT --host=0.0.0.0 \
    --advertise_host=\$(hostname -I | cut -d' ' -f1) --port=$WORKER_PORT > worker.log 2>&1 &"
done
echo "$dispatcher_ip:$DISPATCHER_PORT"
