#!/bin/bash
# Plain Slurm + torchrun: one torchrun per node, torchrun starts one rank per GPU.
#   sbatch recipes/cluster/sbatch_torchrun.sh +stage=zero3 offload=cpu train.steps=5000
# Everything after the script name is passed to `python -m framework.train` as overrides.
#SBATCH --job-name=framework
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one torchrun per node
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --time=04:00:00
#SBATCH --output=slurm-%j.out
set -euo pipefail

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# A port per job (from its id): two jobs whose first node is the same host would otherwise share one
# rendezvous store, and one job's ranks die when the other job ends. MASTER_PORT overrides it.
PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 40000))}
# Every rank must write into one run folder on a shared file system (ranks of different nodes
# would otherwise resolve ${now:...} at different seconds). A job Slurm requeues (pre-emption with
# PreemptMode=REQUEUE, scontrol requeue) keeps its id, so its folder, and resumes from the last periodic
# save (checkpoint.every).
RUN_DIR=${RUN_DIR:-outputs/slurm-$SLURM_JOB_ID}

srun torchrun \
    --nnodes "$SLURM_JOB_NUM_NODES" \
    --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-id "$SLURM_JOB_ID" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$HEAD_NODE:$PORT" \
    -m framework.train \
    model=gpt2-small data=tokens data.path=data/openwebtext/train.bin data.vocab_size=50304 \
    precision=bf16 dist.backend=nccl dist.timeout_s=900 checkpoint.every=500 "hydra.run.dir=$RUN_DIR" "$@"
