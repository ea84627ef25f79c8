"""Training infrastructure: the config, processes and sharding, the policy model and its log-prob
head, scoring π_old / π_ref, micro-batches, the optimizer, checkpoints, metrics, the memory plan and
a run's machinery around the loop."""
