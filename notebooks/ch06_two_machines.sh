#!/bin/bash
# ch06_two_machines.sh: the same training on two (or more) machines, without a scheduler.
#
# Run it on EVERY machine, with the same RDZV_HOST, RDZV_PORT and JOB_ID:
#
#   RDZV_HOST=10.1.1.20 RDZV_PORT=29400 IFNAME=eth0 JOB_ID=run-42 ./ch06_two_machines.sh --steps 5000
#
#   RDZV_HOST       the first machine's address on IFNAME (or a name that resolves to it);
#                   that machine hosts the rendezvous
#   RDZV_PORT       a free port on it; the same everywhere. The firewall must let ALL TCP traffic
#                   through between the machines: the workers' store and gloo/NCCL use further
#                   ports, picked at run time
#   IFNAME          the interface the machines reach each other on (`ip -br addr` lists them)
#   JOB_ID          any name, the same on every machine, a new one for each job
#   NNODES          machines in the job (2);  NPROC_PER_NODE: workers per machine (gpu: one per GPU)
#   PYTHON          the environment's python (python);  DRY_RUN=1 prints the command instead
set -euo pipefail
: "${RDZV_HOST:?set RDZV_HOST to the address of the first machine}"
: "${RDZV_PORT:?set RDZV_PORT to a free port on the first machine}"
: "${IFNAME:?set IFNAME to the interface the machines reach each other on}"
: "${JOB_ID:?set JOB_ID to a name for this job, the same on every machine}"

# This machine's address on IFNAME: the address the other machines will be told to use.
LOCAL_ADDR=${LOCAL_ADDR:-$(ip -4 -o addr show dev "$IFNAME" | awk '!seen++ {split($4, a, "/"); print a[1]}')}
[[ -n "$LOCAL_ADDR" ]] || { echo "no IPv4 address on $IFNAME" >&2; exit 1; }
# The machine that owns RDZV_HOST hosts the rendezvous. torchrun guesses that from the hostname,
# which fails when RDZV_HOST belongs to a second network card: say it outright instead. A name is
# first resolved to its address, else no machine would match and none would host it.
RDZV_IP=$(getent ahostsv4 "$RDZV_HOST" | awk 'NR == 1 {print $1}')
[[ -n "$RDZV_IP" ]] || { echo "RDZV_HOST=$RDZV_HOST does not resolve to an IPv4 address" >&2; exit 1; }
IS_HOST=0
if [[ "$LOCAL_ADDR" == "$RDZV_IP" ]]; then IS_HOST=1; fi

export NCCL_SOCKET_IFNAME=$IFNAME        # NCCL: bootstrap and socket traffic between machines
export GLOO_SOCKET_IFNAME=$IFNAME        # gloo: the same
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}    # INFO on new machines: the interfaces and transports chosen
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # restarted workers get a fresh store (chapter 06, 5.1)

cmd=("${PYTHON:-python}" -m torch.distributed.run
     --nnodes="${NNODES:-2}"
     --nproc_per_node="${NPROC_PER_NODE:-gpu}"
     --rdzv_backend=c10d
     --rdzv_endpoint="$RDZV_HOST:$RDZV_PORT"
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
