"""Accuracy of a checkpoint (or any from_pretrained path) on an eval set: greedy and mean@k.

    python eval.py --config configs/grpo.yaml --model.name_or_path=runs/grpo/checkpoint-150
    python eval.py --config configs/grpo.yaml --eval.num_samples=8 --eval.output=results.json
    torchrun --nproc_per_node=N eval.py --config ...          (prompts are split over ranks)

The engine is `rollout.engine` (auto: vLLM where installed; `--rollout.engine=hf` for
transformers). It reads the same config as train.py (data.eval / data.eval_split, prompt format, generation
length, eval.* sampling settings) and runs the same evaluation code train.py runs periodically.
"""
from __future__ import annotations

import json
import sys

from pspo import distributed
from pspo.config import ConfigError, load_config
from pspo.data import DataError, load_examples
from pspo.distributed import print0
from pspo.evaluation import evaluate
from pspo.model import ModelError, build_policy, load_tokenizer, resolve_model_path
from pspo.rollout import build_engine, engine_name
from train import check_golds, prepare_prompts


def main(argv: list[str]) -> dict[str, float]:
    dist_ = distributed.init_distributed()
    if len(argv) < 2 or argv[0] != "--config":
        raise ConfigError("usage: eval.py --config FILE.yaml [--section.key=value ...]")
    cfg = load_config(argv[1], argv[2:], dist_.world_size)
    d, e, m = cfg.data, cfg.eval, cfg.model
    if not d.eval:
        raise ConfigError("data.eval: expected a dataset to evaluate on, got ''")
    if dist_.is_main:
        resolve_model_path(m.name_or_path)                                     # build builtin:tiny once
    distributed.barrier()
    path = resolve_model_path(m.name_or_path)
    tokenizer = load_tokenizer(path, m.trust_remote_code)
    examples = load_examples(d.eval, d.eval_split, d.problem_field, d.answer_field, d.max_eval_examples or None)
    check_golds(examples, d.eval)
    texts, ids = prepare_prompts(examples, tokenizer, d.system_prompt)
    policy = None
    if engine_name(cfg.rollout.engine) == "hf":                                  # vLLM loads its own copy
        policy = build_policy(path, m.trust_remote_code, m.logprob_chunk_tokens, m.bf16, False, trainable=False)
        policy = distributed.shard(policy.to(dist_.device), dist_.world_size)
    engine = build_engine(cfg.rollout, policy, path, tokenizer, max(len(p) for p in ids), cfg.train.seed,
                          dist_.world_size)
    result = evaluate(engine, ids, texts, examples, cfg.rollout.max_new_tokens, e.num_samples, e.temperature,
                      e.top_p, cfg.train.seed, dist_, e.batch_size, cfg.reward.timeout_s, cfg.train.progress)
    print0(f"\n{'model':<40} {'dataset':<24} {'n':>6} " + " ".join(f"{k:>16}" for k in result))
    print0(f"{path[-40:]:<40} {(d.eval + ':' + d.eval_split)[-24:]:<24} {len(examples):>6} "
           + " ".join(f"{v:>16.4f}" for v in result.values()))
    if e.output and dist_.is_main:
        with open(e.output, "w") as f:
            json.dump({"model": path, "dataset": d.eval, "split": d.eval_split, "n": len(examples),
                       "max_new_tokens": cfg.rollout.max_new_tokens, "temperature": e.temperature,
                       "top_p": e.top_p, **result}, f, indent=2)
        print0(f"wrote {e.output}")
    return result


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, DataError, ModelError, ImportError) as err:
        print0(f"error: {err}")
        sys.exit(2)
    finally:
        distributed.shutdown()
