"""A training run's machinery around the loop (train.py): its models, the resume of a checkpoint, its
folder, and the rules that end a step (timings, when to evaluate and save, when to stop).

A refused run writes nothing: every check that can refuse it (the model, its context, the memory
plan, the PRM, the data, the sampler, the checkpoint to resume and the engine) runs before
`open_folder` writes the first file (config.yaml, then the metrics). It prints nothing but its one line:
`load_models` and `resume` print nothing, and train.py prints the start-up lines (`trainable_line` among
them) once they have loaded. And a mistake is found before anything slow: the checks that need no model
(the folder, `check_writable`; the checkpoint to resume; the data) run before a model is built or loaded.
"""
from __future__ import annotations

import os

import torch

from pspo.training import checkpoint, distributed
from pspo.training.compiled import take_counts
from pspo.training.config import Config, ConfigError, LoraConfig, report_sinks, save_config, to_dict
from pspo.training.distributed import Dist
from pspo.training.metrics import MetricsLogger, StepClock
from pspo.training.lora import BaseReference, load_adapter_weights, trainable_share
from pspo.training.model import Policy, build_policy, check_packing, configure_scoring
from pspo.training.packed_attention import Kernels
from pspo.training.optim import adopt_optim_config

MAX_SKIPPED_IN_A_ROW = 3     # non-finite updates in a row before the run stops


class NonFiniteError(RuntimeError):
    """Several updates in a row were non-finite: the run stops (weights untouched, saved)."""


def load_models(cfg: Config, dist_: Dist, path: str, base_path: str,
                kernels: Kernels, checkpointing: str) -> tuple[Policy, Policy | None]:
    """The policy from `path` (the base model or the checkpoint resumed) and, when algo.needs_reference
    (the k3 loss term or REINFORCE++'s KL reward), the frozen reference from `base_path`, each on the
    rank's device and sharded over the ranks, scoring with the attention `kernels` chosen at start-up.
    checkpointing: model.gradient_checkpointing resolved (plan.startup_check). Prints nothing: a load that
    fails is the run's only line (train.py prints the start-up lines once every load has passed)."""
    m = cfg.model
    lora, resumed = m.lora.rank > 0, path != base_path      # a checkpoint of the same kind (resolve_resume)
    policy = build_policy(base_path if lora else path, trust_remote_code=m.trust_remote_code,
                          chunk_tokens=m.logprob_chunk_tokens, bf16=m.bf16,
                          gradient_checkpointing=checkpointing, lora=m.lora)
    configure_scoring(policy, cfg, kernels, dist_.device)               # before sharding (compiled layers)
    if lora and resumed:
        load_adapter_weights(policy.peft, path, m.lora)                 # the checkpoint resumed
    check_packing(policy, cfg.train)
    policy = distributed.shard(policy.to(dist_.device), dist_.world_size, m.bf16)
    if lora and dist_.world_size > 1:
        # FSDP2 reads which parameters train at its first forward; the KL reference's (adapters off) would
        # record them frozen, so the policy's own runs first
        with torch.no_grad():
            ids = torch.ones(1, 2, dtype=torch.long, device=dist_.device)
            policy(ids, torch.ones_like(ids), 1, 1.0)
    if not cfg.algo.needs_reference:
        return policy, None
    if lora:
        return policy, BaseReference(policy)                            # the base: adapters off, no copy
    ref = build_policy(base_path, trust_remote_code=m.trust_remote_code, chunk_tokens=m.logprob_chunk_tokens,
                       bf16=m.bf16, trainable=False)
    configure_scoring(ref, cfg, kernels, dist_.device)
    return policy, distributed.shard(ref.to(dist_.device), dist_.world_size, m.bf16)


def resume(path: str, *, cfg: Config, dist_: Dist, policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
           scheduler, sampler, method_state, sampler_mode: str) -> tuple[int, float]:
    """Load a checkpoint's optimizer, schedule, sampler and method state (methods.MethodState) into
    the run's; returns (step, generated_tokens). Refused (CheckpointError, ConfigError) for a file it
    cannot read or a checkpoint trained under another method or sampler (checkpoint.py)."""
    state = checkpoint.load_trainer_state(path, dist_.rank)
    checkpoint.load_optimizer(path, policy, optimizer)
    scheduler.load_state_dict(state["scheduler"])
    adopt_optim_config(optimizer, scheduler, cfg)
    checkpoint.restore_trainer_state(state, sampler, method_state, cfg, sampler_mode)
    return state["step"], state.get("generated_tokens", 0.0)


def trainable_line(policy: torch.nn.Module, lora: LoraConfig) -> str:
    """The start-up line of the policy's trainable share (sharded or not: a DTensor counts its whole shape)."""
    trainable, total = trainable_share(policy)
    return (f"trainable parameters: {trainable:,} of {total:,} ({trainable / total:.2%})"
            + (f", LoRA rank {lora.rank} on {lora.target_modules}" if lora.rank > 0 else ""))


def check_writable(path: str, key: str, *, folder: bool) -> None:
    """ConfigError (one line naming `key`) unless this process can write `path`: a folder (made with its
    parents, train.output_dir) or a file in a folder that exists (eval.output). Run at start-up, before
    anything slow, so that a run never ends on a path it cannot write."""
    kind = "folder" if folder else "file"
    if os.path.exists(path) and os.path.isdir(path) != folder:
        raise ConfigError(f"{key}: {path!r} is a {'file' if folder else 'folder'}, expected a {kind}")
    if os.path.exists(path):
        ok = os.access(path, os.W_OK | (os.X_OK if folder else 0))
        if not ok:
            raise ConfigError(f"{key}: {path!r}: permission denied, expected a {kind} this process can write")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while folder and not os.path.exists(parent):              # made with its parents (os.makedirs)
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        what = "is a file" if os.path.exists(parent) else "does not exist"
        raise ConfigError(f"{key}: cannot create {path!r}: {parent!r} {what}, expected a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot create {path!r}: permission denied in {parent!r}")


def open_folder(cfg: Config, dist_: Dist, step: int) -> MetricsLogger:
    """The run's first writes, once nothing can refuse it: its config.yaml and its metrics (rank 0). The
    metrics' compile counts start here: an earlier run in this process (a test's) counted its own."""
    take_counts()
    out = cfg.train.output_dir
    if dist_.is_main:
        os.makedirs(out, exist_ok=True)
        save_config(cfg, os.path.join(out, "config.yaml"))
    t = cfg.train
    return MetricsLogger(out, dist_.is_main, resume_step=step, report_to=t.report_to, run_config=to_dict(cfg),
                         project=t.wandb_project)


def last_step(cfg: Config, step: int, generated_tokens: float) -> bool:
    """The run ends after this step: train.max_steps reached, or its token budget (train.max_generated_tokens,
    every rank's generated tokens so far). Checked after a step, so the budget is passed by less than the last
    step's tokens; a run resumed past its budget trains one more step."""
    budget = cfg.train.max_generated_tokens
    return step == cfg.train.max_steps or (budget > 0 and generated_tokens >= budget)


def every(step: int, interval: int) -> bool:
    """A periodic event (eval, save) is due at this step; interval 0 = never."""
    return bool(interval) and step % interval == 0


def timings(clock: StepClock, update_tokens: float) -> dict[str, float]:
    """The step's phase times as the loop's clock measured them (this rank's; rank 0 logs), the
    update's throughput over `update_tokens` (all ranks') and the step's time so far."""
    times = dict(clock.times)
    times["update_tokens_per_s"] = update_tokens / max(times["update_s"], 1e-9)
    times["step_time_s"] = clock.elapsed()
    return times


def non_finite_error(step: int) -> NonFiniteError:
    return NonFiniteError(f"optim.lr: {MAX_SKIPPED_IN_A_ROW} updates in a row had a non-finite loss or "
                          f"gradient norm (steps {step - MAX_SKIPPED_IN_A_ROW + 1}-{step}); they were "
                          "skipped and the weights are as before them (saved). Lower optim.lr or check the "
                          "model and data, then resume with --train.resume=auto")


def summary(cfg: Config, step: int, generated_tokens: float, first_eval: dict, last_eval: dict,
            num_eval: int) -> str:
    """The run's last lines: where a token budget stopped it, test accuracy before -> after (when it finished),
    and where the metrics are."""
    lines = []
    finished = last_step(cfg, step, generated_tokens)                               # not preempted
    if finished and step < cfg.train.max_steps:
        lines.append(f"token budget reached: {generated_tokens:,.0f} tokens generated in {step} steps "
                     f"(train.max_generated_tokens={cfg.train.max_generated_tokens:,})")
    if finished and first_eval and last_eval:
        k = f"eval_mean@{cfg.eval.num_samples}"                     # sampled accuracy (eval.num_samples > 0)
        line = (f"test accuracy: {first_eval['eval_accuracy']:.3f} before -> "
                f"{last_eval['eval_accuracy']:.3f} after (greedy, {num_eval} problems)")
        if k in last_eval:
            line += f"; {k[5:]} at T {cfg.eval.temperature}: {first_eval[k]:.3f} -> {last_eval[k]:.3f}"
        lines.append(line)
    elif finished and last_eval:
        lines.append(f"test accuracy after step {step}: {last_eval['eval_accuracy']:.3f}")
    out = cfg.train.output_dir
    sinks = report_sinks(cfg.train.report_to)
    lines.append(f"metrics: {os.path.join(out, 'metrics.jsonl')}"
                 + (f"   TensorBoard: tensorboard --logdir {out}" if "tensorboard" in sinks else "")
                 + (f"   W&B: project {cfg.train.wandb_project}" if "wandb" in sinks else ""))
    return "\n".join(lines)
