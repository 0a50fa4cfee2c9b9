#!/bin/bash
# ch06_two_machines.sh: the same training on two (or more) machines, without a scheduler.
#
# Run it on EVERY machine, with the same MASTER_ADDR, MASTER_PORT and JOB_ID:
#
#   MASTER_ADDR=10.1.1.20 MASTER_PORT=29400 IFNAME=eth0 JOB_ID=run-42 ./ch06_two_machines.sh --steps 5000
#
#   MASTER_ADDR     the first machine's address on IFNAME; that machine hosts the rendezvous
#   MASTER_PORT     a port the firewall lets through between the machines; the same everywhere
#   IFNAME          the interface the machines reach each other on (`ip -br addr` lists them)
#   JOB_ID          any name, the same on every machine, a new one for each job
#   NNODES          machines in the job (2);  NPROC_PER_NODE: workers per machine (gpu: one per GPU)
#   PYTHON          the environment's python (python);  DRY_RUN=1 prints the command instead
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to the address of the first machine}"
: "${MASTER_PORT:?set MASTER_PORT to a port open between the machines}"
: "${IFNAME:?set IFNAME to the interface the machines reach each other on}"
: "${JOB_ID:?set JOB_ID to a name for this job, the same on every machine}"

# This machine's address on IFNAME: the address the other machines will be told to use.
LOCAL_ADDR=${LOCAL_ADDR:-$(ip -4 -o addr show dev "$IFNAME" | awk '!seen++ {split($4, a, "/"); print a[1]}')}
[[ -n "$LOCAL_ADDR" ]] || { echo "no IPv4 address on $IFNAME" >&2; exit 1; }
# The machine that owns MASTER_ADDR hosts the rendezvous. torchrun guesses that from the hostname,
# which fails when MASTER_ADDR belongs to a second network card: say it outright instead.
IS_HOST=0
if [[ "$LOCAL_ADDR" == "$MASTER_ADDR" ]]; then IS_HOST=1; fi

export NCCL_SOCKET_IFNAME=$IFNAME        # NCCL: bootstrap and socket traffic on this interface
export GLOO_SOCKET_IFNAME=$IFNAME        # gloo: the same
export NCCL_DEBUG=${NCCL_DEBUG:-INFO}    # NCCL prints the interfaces and transports it chose
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # restarted workers get a fresh store (chapter 06, 5.1)

cmd=("${PYTHON:-python}" -m torch.distributed.run
     --nnodes="${NNODES:-2}"
     --nproc_per_node="${NPROC_PER_NODE:-gpu}"
     --rdzv_backend=c10d
     --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"
     --rdzv_id="$JOB_ID"
     --rdzv_conf="is_host=$IS_HOST"
     --local-addr="$LOCAL_ADDR"
     --max-restarts="${MAX_RESTARTS:-1}"
     "$(dirname "$0")/ch06_train.py" "$@")

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    echo "NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME" \
         "NCCL_DEBUG=$NCCL_DEBUG TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 ${cmd[*]}"
else
    exec "${cmd[@]}"
fi
