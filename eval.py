"""Accuracy of a checkpoint (or any from_pretrained path): greedy, mean@k (= pass@1 from k samples), pass@k.

    python eval.py --config configs/grpo.yaml --model.name_or_path=runs/grpo/checkpoint-150
    python eval.py --config configs/grpo.yaml --eval.num_samples=8 --eval.output=results.json
    python eval.py --config configs/qwen2.5-math-1.5b/pspo.yaml --model.name_or_path=CKPT \
        --benchmarks=aime24,math500,amc23,minerva,olympiadbench,gsm8k --engine=vllm \
        --eval.num_samples=8 --eval.temperature=0.6 --eval.top_p=0.95 --eval.output=bench.json
          (the paper's setting; a benchmark may be name=FILE, a local copy in the hub format)
    torchrun --nproc_per_node=N eval.py --config ...          (prompts are split over ranks)

The engine is `rollout.engine` (auto: vLLM where installed; `--rollout.engine=hf` for
transformers). It reads the same config as train.py (data.eval / data.eval_split, prompt format, generation
length, eval.* sampling settings) and runs the same evaluation code train.py runs periodically.
Rows whose gold answer does not parse and prompts longer than data.max_prompt_tokens are left out
at load time (one report line per set; data.bad_gold=error stops instead); the table's and the
JSON's `skipped` counts them, `n` counts the rows evaluated. On knights-and-knaves puzzles
(`--data.eval=builtin:knights`, or a file in the hub's or PaddleNLP's K&K layout) accuracy is the
exact match of every role, and the table and JSON add the greedy accuracy per number of people,
`greedy_2ppl` .. `greedy_8ppl` (pspo/evaluation.py):

    python eval.py --config configs/grpo.yaml --model.name_or_path=CKPT --data.eval=builtin:knights
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import torch

from pspo.training import distributed
from pspo.tasks.benchmarks import BENCHMARKS, load_benchmark
from pspo.training.config import ConfigError, load_config
from pspo.tasks.data import DataError, Rows, load_examples, tokenized, usable_rows
from pspo.training.distributed import print0
from pspo.evaluation import evaluate
from pspo.offline.builtin import resolve_model_path
from pspo.training.lora import LoraError, is_adapter, merged_for_eval
from pspo.training.model import ModelError, build_policy, check_context, load_model_config, load_tokenizer
from pspo.tasks.reward_pool import RewardPool, resolve_workers
from pspo.rollout import build_engine, engine_name
from pspo.training.run import check_writable

FLAGS = ("--benchmarks", "--engine")
USAGE = ("usage: eval.py --config FILE.yaml [--benchmarks=" + ",".join(BENCHMARKS) + "] [--engine=vllm|hf] "
         "[--section.key=value ...]   (a benchmark may be name=FILE, a local copy)")


def main(argv: list[str]) -> dict:
    dist_ = distributed.init_distributed()
    if len(argv) < 2 or argv[0] != "--config":
        raise ConfigError(USAGE)
    flags = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv[2:]
             if a.split("=", 1)[0] in FLAGS and "=" in a}
    overrides = [a for a in argv[2:] if a.split("=", 1)[0] not in FLAGS]
    if "--engine" in flags:
        overrides.append(f"--rollout.engine={flags['--engine']}")
    cfg = load_config(argv[1], overrides, dist_.world_size)
    m = cfg.model
    # the checks that need no model, before one is built or loaded: the output file, the engine, the data
    if cfg.eval.output:
        check_writable(cfg.eval.output, "eval.output", folder=False)
    engine_name(cfg.rollout.engine)
    suites = eval_rows(cfg, flags)
    if dist_.is_main:
        resolve_model_path(m.name_or_path)                                     # build builtin:tiny once
    distributed.barrier()
    path = checkpoint = resolve_model_path(m.name_or_path)
    if is_adapter(path):                          # a LoRA checkpoint: its adapter merged into its base
        path = merged_for_eval(path, distributed.barrier)
        print0(f"{checkpoint}: a LoRA adapter, merged into its base for evaluation ({path})")
    try:
        results = evaluate_model(cfg, flags, path, dist_, suites)
        distributed.barrier()                     # every rank is done reading the merged folder
        return results
    finally:
        if path != checkpoint and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(path, ignore_errors=True)


def eval_rows(cfg, flags: dict) -> dict[str, Rows]:
    """The eval sets by name: --benchmarks, or data.eval; read and their golds checked (rows without a
    usable gold are left out), with no model."""
    d = cfg.data
    suites: dict[str, Rows] = {}
    if flags.get("--benchmarks"):
        for spec in flags["--benchmarks"].split(","):
            name, source, examples = load_benchmark(spec, d.max_eval_examples or None)
            suites[name] = usable_rows(f"{name} ({source})", examples, bad_gold=d.bad_gold)
    elif d.eval:
        examples = load_examples(d.eval, split=d.eval_split, problem_field=d.problem_field,
                                 answer_field=d.answer_field, max_examples=d.max_eval_examples or None)
        suites[f"{d.eval}:{d.eval_split}"] = usable_rows(f"data.eval {d.eval}", examples, bad_gold=d.bad_gold)
    else:
        raise ConfigError("data.eval: expected a dataset to evaluate on (or --benchmarks=...), got ''")
    return suites


def evaluate_model(cfg, flags: dict, path: str, dist_, rows: dict[str, Rows]) -> dict:
    """The evaluation of main, on a plain (or merged) model folder, of the eval sets `rows` (eval_rows)."""
    d, e, m = cfg.data, cfg.eval, cfg.model
    pool = RewardPool(resolve_workers(cfg.reward.workers, torch.get_num_threads()))    # starts while loading
    tokenizer = load_tokenizer(path, m.trust_remote_code)
    check_context(load_model_config(path, m.trust_remote_code), d.max_prompt_tokens,
                  cfg.rollout.max_new_tokens)
    # prompts longer than data.max_prompt_tokens are left out
    suites = {name: tokenized(r, tokenizer, system_prompt=d.system_prompt, max_prompt_tokens=d.max_prompt_tokens)
              for name, r in rows.items()}
    policy = None
    if engine_name(cfg.rollout.engine) == "hf":                                  # vLLM loads its own copy
        policy = build_policy(path, trust_remote_code=m.trust_remote_code, chunk_tokens=m.logprob_chunk_tokens,
                              bf16=m.bf16, trainable=False)
        policy = distributed.shard(policy.to(dist_.device), dist_.world_size, m.bf16)
    longest = max(len(p) for suite in suites.values() for p in suite.ids)
    engine = build_engine(cfg.rollout, policy, path, tokenizer, max_prompt_len=longest, seed=cfg.train.seed,
                          world_size=dist_.world_size, bf16=m.bf16)
    results = {}
    for name, suite in suites.items():
        results[name] = {"n": len(suite.examples), "skipped": suite.skipped, **evaluate(
            engine, suite.ids, suite.texts, suite.examples, max_new_tokens=cfg.rollout.max_new_tokens,
            num_samples=e.num_samples, temperature=e.temperature, top_p=e.top_p, seed=cfg.train.seed,
            dist_=dist_, batch_size=e.batch_size, timeout_s=cfg.reward.timeout_s,
            progress=cfg.train.progress, pool=pool)}
    pool.close()
    counts = ("n", "skipped")                     # rows evaluated, rows left out (bad gold + too long)
    if len(results) > 1:                          # unweighted mean over benchmarks, as papers report
        keys = [k for k in next(iter(results.values())) if k not in counts]
        results["average"] = {**{c: sum(r[c] for r in results.values()) for c in counts},
                              **{k: sum(r[k] for r in results.values()) / len(results) for k in keys}}
    columns = [k for k in next(iter(results.values())) if k not in counts]
    print0(f"\nmodel: {path}   engine: {engine_name(cfg.rollout.engine)}   max_new_tokens "
           f"{cfg.rollout.max_new_tokens}" + (f"   mean@k/pass@k: k={e.num_samples}, T={e.temperature}, "
                                              f"top_p={e.top_p}" if e.num_samples else ""))
    print0(f"{'eval set':<36} {'n':>6} {'skipped':>8} " + " ".join(f"{k:>16}" for k in columns))
    for name, r in results.items():
        print0(f"{name[-36:]:<36} {r['n']:>6} {r['skipped']:>8} "
               + " ".join(f"{r[k]:>16.4f}" for k in columns))
    if e.output and dist_.is_main:
        settings = {"model": path, "engine": engine_name(cfg.rollout.engine),
                    "max_new_tokens": cfg.rollout.max_new_tokens, "num_samples": e.num_samples,
                    "temperature": e.temperature, "top_p": e.top_p}
        with open(e.output, "w") as f:
            if flags.get("--benchmarks"):
                json.dump({**settings, "benchmarks": results}, f, indent=2)
            else:
                json.dump({**settings, "dataset": d.eval, "split": d.eval_split,
                           **next(iter(results.values()))}, f, indent=2)
        print0(f"wrote {e.output}")
    return results


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, DataError, ModelError, LoraError, ImportError, FileNotFoundError) as err:
        print0(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    finally:
        distributed.shutdown(clean=sys.exc_info()[0] is None)          # None: main returned
