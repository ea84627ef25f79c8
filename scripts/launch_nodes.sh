#!/usr/bin/env bash
# train.py on one node of several: torchrun starts NPROC_PER_NODE ranks here, and they meet the other nodes'
# ranks at MASTER_ADDR:MASTER_PORT (c10d rendezvous, hosted by the node at that address, which hands out
# the ranks: every node runs the same command). Arguments go to train.py. On each of two 8-GPU nodes:
#   NNODES=2 NPROC_PER_NODE=8 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash scripts/launch_nodes.sh --config FILE
# scripts/slurm.sbatch runs it on every node of a Slurm job; tests/e2e/test_loop.py runs that script with
# two nodes on 127.0.0.1. torchrun passes SIGTERM and SIGUSR1 on to the ranks and waits up to 600 s for
# them to save and exit (docs/gpu.md, "Preemption under torchrun").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec torchrun --nnodes="${NNODES:?set NNODES, the number of nodes}" \
  --nproc_per_node="${NPROC_PER_NODE:?set NPROC_PER_NODE, the ranks (GPUs) on this node}" \
  --rdzv_backend=c10d \
  --rdzv_endpoint="${MASTER_ADDR:?set MASTER_ADDR, the address of the first node}:${MASTER_PORT:-29500}" \
  --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout=600 \
  train.py "$@"
