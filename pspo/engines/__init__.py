"""The rollout engines behind pspo/rollout.py's contract: transformers on the training model
(hf_engine.py, with the static-cache decoder of decode.py), vLLM with its own synced copy of the
weights (vllm_engine.py); counter-based sampling and seeds (sampling.py). The record they return and
the padding they share are training/tokens.py's, which the trainer reads too."""
