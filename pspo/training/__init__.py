"""Training infrastructure: the config, processes and sharding, the policy model and its log-prob
head, scoring π_old / π_ref, token rows (what an engine returns, padding), micro-batches, the
optimizer, checkpoints, metrics, the memory plan and a run's machinery around the loop."""
