#!/bin/bash
# ch06_slurm_srun.sh: the same job without torchrun: srun starts every worker itself.
#
#   sbatch ch06_slurm_srun.sh --steps 5000         # arguments go to ch06_train.py
#
# One Slurm task per GPU, and every task is a worker. What torchrun would set, Slurm already has:
#   RANK = SLURM_PROCID   LOCAL_RANK = SLURM_LOCALID   WORLD_SIZE = SLURM_NTASKS
#   GROUP_RANK = SLURM_NODEID   MASTER_ADDR = the first node (task 0 runs there and hosts the store)
# What is lost: torchrun's restarts (--max-restarts). A failed worker ends the step (srun
# --kill-on-bad-exit) and the job; requeueing it (--requeue) resumes from the checkpoint.
# GPUs: with --gpus-per-node every task sees all the node's GPUs and takes cuda:LOCAL_RANK. With
# per-task binding (--gpus-per-task=1, --gpu-bind=...) a task sees only its own GPU, as cuda:0;
# ch06_train.py notices (CUDA_VISIBLE_DEVICES names one device) and takes cuda:0.
#SBATCH --job-name=ch06-ddp-srun
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=02:00:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out

set -euo pipefail

PYTHON=${PYTHON:-python}                 # the same environment on every node
TRAIN=${TRAIN:-ch06_train.py}            # on a file system that every node sees
CKPT_DIR=${CKPT_DIR:-$PWD/checkpoints}   # likewise
DATA_DIR=${DATA_DIR:-${TMPDIR:-/tmp}}    # node-local
RUN_ID=${RUN_ID:-$SLURM_JOB_NAME-$SLURM_JOB_ID}   # requeued: same id, same checkpoint

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
export MASTER_ADDR=${NODES[0]}                     # task 0 (rank 0) runs on the first node
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))   # as in ch06_slurm.sbatch
# Rank 0 hosts the store there: if another job holds the port, rank 0 fails at once with
# EADDRINUSE and --kill-on-bad-exit ends the other tasks.
if [[ -n "${IFNAME:-}" ]]; then
    export NCCL_SOCKET_IFNAME=$IFNAME GLOO_SOCKET_IFNAME=$IFNAME
fi
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK        # one task is one worker
mkdir -p "$CKPT_DIR"

worker() {
    export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS
    export GROUP_RANK=$SLURM_NODEID LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE
    exec "$PYTHON" "$TRAIN" --ckpt "$CKPT_DIR/$RUN_ID.pt" --data-dir "$DATA_DIR" "$@"
}
export -f worker
export PYTHON TRAIN CKPT_DIR DATA_DIR RUN_ID

srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" bash -c 'worker "$@"' worker "$@"
