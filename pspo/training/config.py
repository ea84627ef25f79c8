"""Typed configuration: dataclasses filled from YAML, then `--section.key=value` overrides.

Precedence is CLI > YAML > the defaults below. Every field has one comment naming its symbol in
docs/methods.md (where it has one) and its unit. Validation runs once, right after loading, and a
mistake is one `ConfigError` line naming the key (train.py turns it into exit code 2).
A YAML file may start with `base: other.yaml` (relative to itself) to inherit from a preset.

The sections: model, data, rollout, reward, prm (PSPO*'s process reward, docs/related.md §C), algo,
ers, pps, optim, train, eval, spo (SPO-chain / SPO-tree, docs/related.md §B, with its own
checks in `validate_spo`) and single_stream (Single-stream PO's tracker, docs/methods.md §10, with its
own checks in `validate_single_stream`). `ConfigError`, `check`, `first_line` and `error_line` are also how the
components that turn a library's exception into one line (model loading, the PRM, the memory plan,
data loading, checkpoints, vLLM) report it.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from pspo.estimators import WHITENINGS
from pspo.is_correction import IS_CORRECTIONS
from pspo.loss import AGGREGATIONS, OBJECTIVES
from pspo.priority_sampler import BETA_PRIORITIES, IS_NORMS, PRIORITIES


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message is one line naming the key."""


# "reference" is the KL reference model only: the paper's released code's mode, split and presets are "released",
# and their old names are refused in one line naming the new
RENAMED_VALUE = "'reference' is now 'released' (the paper's released code; 'reference' is the KL reference model only)"
RENAMED_PRESETS = {"pspo_reference.yaml": "pspo_released.yaml"}


def check(ok: bool, key: str, expected: str, value: Any) -> None:
    """Raise ConfigError "key: expected ..., got value" unless ok."""
    if not ok:
        raise ConfigError(f"{key}: expected {expected}, got {value!r}")


def parse_ints(text: str) -> tuple[int, ...]:
    """"6,6,6" -> (6, 6, 6); () if a part is not an integer."""
    try:
        return tuple(int(part) for part in str(text).split(","))
    except ValueError:
        return ()


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of e's message, at most `limit` characters; e's type name if it has none."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


def report_sinks(report_to: str) -> list[str]:
    """train.report_to's sinks: "tensorboard,wandb" -> ["tensorboard", "wandb"]."""
    return [part.strip() for part in report_to.split(",")]


def error_line(e: BaseException, limit: int = 300) -> str:
    """"TypeName: " + first_line(e, limit), or the type name alone if e has no message."""
    name = type(e).__name__
    return f"{name}: {first_line(e, limit)}" if str(e).strip() else name


# The R1 prompt of the open-rs / Open-R1 recipes: reason in <think> </think>, answer in \boxed{}.
# Departure from the recipes' text: they also ask for <answer> </answer> tags (and print a literal
# "\boxed{{}}"); our format reward (docs/methods.md §5) wants <think>..</think> then \boxed{...}.
R1_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer. The reasoning process is enclosed within <think> </think>, followed by the final answer "
    "in \\boxed{}, i.e., <think> reasoning process here </think> The answer is \\boxed{answer here}."
)
SYSTEM_PROMPTS = {"r1": R1_SYSTEM_PROMPT}     # data.system_prompt names; any other value is the text itself

# The names each setting accepts. A name the math implements is the math module's (imported above:
# those modules import nothing of the project, and raise on a name they do not know); the others
# live here, since the modules that pick by them (methods, sampler) import this one.
ADVANTAGES = ("grpo", "rloo", "maxrl", "reinforce_pp", "reinforce_pp_baseline", "spo_chain",
              "spo_tree", "single_stream")                                  # methods.method_for
# the methods whose advantages are one per token, not one per completion broadcast over its tokens
TOKEN_ADVANTAGES = ("reinforce_pp", "reinforce_pp_baseline", "spo_chain", "spo_tree")
# the methods whose baseline is their group's reward statistics, which ERS may smooth (docs/methods.md §2)
GROUP_BASELINES = ("grpo", "rloo", "maxrl", "reinforce_pp_baseline")
PPS_MODES = ("paper", "released")                         # docs/methods.md §3 (+ §3b options) | §3a


@dataclass
class LoraConfig:
    """LoRA adapters through peft (training/lora.py; docs/methods.md §8): rank 0 = full fine-tuning."""
    rank: int = 0                       # r of every adapter; 0 = no adapters, every weight trains
    alpha: float = 32.0                 # the update is (alpha / rank) B A
    dropout: float = 0.0                # must be 0: π_old is scored without dropout, the update must match it
    target_modules: str = "all-linear"  # "all-linear" (every linear layer but the head) or names: q_proj,v_proj

    @property
    def targets(self) -> str | list[str]:
        """target_modules as peft takes it: "all-linear", or the list of module names."""
        if self.target_modules == "all-linear":
            return "all-linear"
        return [name.strip() for name in self.target_modules.split(",")]


@dataclass
class ModelConfig:
    name_or_path: str = "builtin:tiny"  # hub id, local folder, or builtin:tiny (cached demo model)
    trust_remote_code: bool = False     # run model code shipped with a checkpoint (off: safer)
    bf16: bool = False                  # bf16 autocast for forward passes (GPU); log-probs stay fp32
    # activations recomputed in backward to save memory: none | selective (matmul and attention outputs
    # kept, the rest recomputed) | full (each decoder layer) | auto (the cheapest the memory plan fits:
    # docs/gpu.md#plan); true / false, from older configs, mean full / none
    gradient_checkpointing: str = "auto"
    logprob_chunk_tokens: int = 2048    # tokens per (chunk x vocab) logits block in the loss
    lora: LoraConfig = field(default_factory=LoraConfig)
    # the log-prob head's elementwise work: auto (compiled on CUDA, eager elsewhere) | eager | compiled; a
    # failed compile runs it eagerly with one warning (compile_fallbacks), as every compiled path (compiled.py)
    logprob_head: str = "auto"


@dataclass
class DataConfig:
    train: str = "builtin:arithmetic"   # builtin:arithmetic, a .jsonl/.json/.parquet file, or hub name
    train_split: str = "train"          # split of `train`
    # K&K: train on puzzles of these numbers of people only, e.g. "2,3,4" ("" = all; eval keeps every size)
    train_people: str = ""
    eval: str = "builtin:arithmetic"    # eval set, same forms as `train`; "" disables eval
    eval_split: str = "test"            # split of `eval`
    problem_field: str = "problem"      # column holding the question
    answer_field: str = "answer"        # column holding the gold answer
    # system message: "r1" = the R1 prompt (<think> then \boxed{}), else the text ("" = none; one other word
    # is an error)
    system_prompt: str = ""
    max_eval_examples: int = 0          # 0 = the whole eval set
    # 0 = all; else the first N rows (builtin sets: stratified), revisited more often
    max_train_examples: int = 0
    max_prompt_tokens: int = 512        # longer prompts are dropped at load time (logged), never truncated
    # a gold answer math-verify cannot parse: skip (report, leave out) | error
    bad_gold: str = "skip"

    @property
    def people(self) -> tuple[int, ...]:
        """data.train_people as sizes, once validated: "2,3,4" -> (2, 3, 4); "" -> () (all)."""
        return parse_ints(self.train_people) if str(self.train_people).strip() else ()


@dataclass
class RolloutConfig:
    engine: str = "auto"                # vllm | hf (transformers generate) | auto (vllm on a GPU, hf on CPU)
    num_generations: int = 8            # G, completions per prompt (1: algo.advantage=single_stream only)
    temperature: float = 1.0            # T; also divides the logits in the loss (§1)
    top_p: float = 1.0                  # nucleus sampling mass
    max_new_tokens: int = 16            # L_max, tokens per completion
    batch_size: int = 512               # sequences per generate call on one rank (hf engine)
    # hf engine: compile the decoding step: auto (CUDA) | always | never; a failed compile runs the step
    # eagerly with one warning and the compile_fallbacks metric, as every compiled path (compiled.py)
    compile: str = "auto"
    gpu_memory_utilization: float = 0.3  # vllm: fraction of GPU memory for weights + KV cache
    sleep: bool = False                 # vllm on GPU: free its memory while the trainer updates
    sync_check_steps: int = 10          # vllm: check the engine's weights at the first step, then every N (0 = off)
    # engine/trainer mismatch (§7): the PG term weighted by r = π_old/π_engine per token | sequence,
    # truncated to [C_low, C] (token, sequence) or zeroed outside it (token_mask, sequence_mask), or the
    # completion's geometric mean exp(mean_t log r_t), zeroed outside [C_low, C] (geo_mask) | none
    is_correction: str = "none"
    is_cap: float = 2.0                 # C, the upper bound of r (> 1)
    is_floor: float = 0.0               # C_low, the lower bound of r (in [0, 1); 0 = none)
    # DAPO's dynamic sampling (docs/methods.md §9): groups whose G rewards are all equal are set aside and
    # more prompts drawn and generated until the step has B groups, or max_sampling_rounds rounds were drawn
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4        # generation rounds per step, the first included (verl's max_num_gen_batches)
    # one step off (docs/methods.md §7b, docs/gpu.md): sync (generate, then update) | async (engine processes
    # generate step s+1 with θ_s while the trainer updates on step s)
    mode: str = "sync"
    lag: int = 1                        # async: steps between the generating weights and the trainer's, 0 | 1
    engines: int = 1                    # async: engine processes, each generating a contiguous slice of the prompts
    # async: one GPU per engine, an index among the GPUs the trainer sees ("4,5,6,7"); "" = the trainer's GPU or CPU
    engine_gpus: str = ""
    engine_cores: str = ""              # async on CPU: cores the engines are pinned to ("1"); the trainer the rest
    engine_timeout_s: float = 300.0     # async: longest wait for an engine's start or answer before the run stops


@dataclass
class RewardConfig:
    accuracy: float = 1.0               # weight of the math-verify accuracy reward (§5)
    format: float = 0.0                 # weight of the <think>..</think> format reward (§5)
    cosine: float = 0.0                 # weight of the cosine length-scaled accuracy (§5)
    # weight of the knights-and-knaves reward, in {3, -0.5, -1, -3} (docs/related.md §A)
    knights: float = 0.0
    prm: float = 0.0                    # weight of PSPO*'s process reward R (docs/related.md §C; section prm)
    # L_cache of DAPO's soft overlong punishment, tokens (docs/methods.md §9): the last L_cache tokens before
    # rollout.max_new_tokens = L_max lower the reward linearly from 0 to -1 (0 = off)
    overlong_cache: int = 0
    timeout_s: float = 5.0              # per-call limit of one reward function, seconds
    # the training reward: verified (the weighted sum of the rewards above) | random (a control, docs/methods.md
    # §5: accuracy · b, b ~ Bernoulli(random_rate) seeded per completion; the logged accuracy stays the verified one)
    kind: str = "verified"
    random_rate: float = 0.0            # reward.kind=random: P(b = 1), the task's measured base rate (required)
    # reward processes per rank (reward_pool.py): 0 = in the trainer, -1 = auto (cores left after the training
    # threads)
    workers: int = -1


# PSPO*'s names live here rather than beside their functions in related/process_reward.py: the
# related methods build on this folder, so the config cannot import them
PRM_SPLITS = ("released", "lines")             # prm.split: process_reward.split_released | split_lines
PRM_SHAPINGS = ("wrs", "weibull", "none")      # prm.shaping: g·ff(g, n) | g·w(n) | g (shaped_reward)


@dataclass
class PRMConfig:
    """The process reward model of reward.prm (PSPO*, docs/related.md §C), loaded when reward.prm != 0."""
    # an AutoModelForSequenceClassification folder or hub id, or builtin:tiny-prm (pspo/offline/tiny_prm.py)
    model: str = ""
    trust_remote_code: bool = False     # run model code shipped with the PRM (off: safer)
    label: int = 2                      # the "correct" class: s_j = softmax(logits)[label] (-1, 0, 1: 2)
    # steps: released (the released code's markers) | lines (and "Step k:")
    split: str = "released"
    # what joins the previous step to the step: "" = the PRM tokenizer's pair encoding (its sep token);
    # else this text (the released code: " </s><s>")
    separator: str = ""
    max_tokens: int = 512               # each scored input truncated to this many tokens
    shaping: str = "wrs"                # R from g and n: wrs g·ff(g, n) | weibull g·w(n) | none g (§C)
    batch_tokens: int = 16384           # padded tokens per PRM forward (the inputs sorted by length)


@dataclass
class AlgoConfig:
    # the advantage method (methods.method_for): grpo (docs/methods.md §1, per completion; Dr. GRPO through
    # scale_rewards) | rloo | maxrl (§1, per completion) | reinforce_pp | reinforce_pp_baseline (docs/related.md §A,
    # per token) | spo_chain | spo_tree (docs/related.md §B, per token, the spo section) | single_stream
    # (Single-stream PO, docs/methods.md §10, per completion, the single_stream section)
    advantage: str = "grpo"
    # divide by the group std (GRPO); false for Dr. GRPO and for RLOO, which refuses it (§1). PPS's priority
    # reads it with any method (the raw GRPO |A|, §3)
    scale_rewards: bool = True
    aggregation: str = "grpo"           # grpo | token_mean | dr_grpo (§1 Aggregation)
    # the policy objective (loss.OBJECTIVES, docs/methods.md §11): ppo_clip (§1) | gspo | gspo_token | cispo | sapo
    objective: str = "ppo_clip"
    # β, weight of the k3 KL to the reference policy in the loss (0 for REINFORCE++)
    beta: float = 0.04
    eps_low: float = 0.2                # ε_low, lower clip of the ratio ρ (gspo: of s_i; cispo: of its IS weight)
    eps_high: float = 0.28              # ε_high, upper clip of the ratio ρ (likewise)
    sapo_tau_pos: float = 1.0           # τ_pos, SAPO's gate temperature where Â > 0 (§11)
    sapo_tau_neg: float = 1.05          # τ_neg, where Â ≤ 0
    num_iterations: int = 1             # PPO epochs (optimizer steps) per rollout batch
    adv_eps: float = 1e-4               # ε in A = (r - μ) / (s + ε); single_stream: in (A - mean) / (std + ε)
    # REINFORCE++ (docs/related.md §A): k1 KL penalty in the token reward, -kl_coef·(logπ_old - logπ_ref)
    # (PaddleNLP's: 1e-3)
    kl_coef: float = 0.0
    # REINFORCE++: the reward is clipped to ±clip_score before it enters the last token
    clip_score: float = 10.0
    # REINFORCE++ token whitening variance: bessel (PaddleNLP, ÷(n-1)) | population (OpenRLHF, ÷n)
    whiten: str = "bessel"
    # DAPO's overlong filtering (docs/methods.md §9): completions that hit max_new_tokens leave the loss
    # (their loss mask is zeroed); their rewards still count in their group's statistics
    overlong_filter: bool = False

    @property
    def needs_reference(self) -> bool:
        """The frozen reference model is built and scored: the k3 loss term (β > 0), or REINFORCE++'s KL
        reward (kl_coef > 0, which validation allows with REINFORCE++ only)."""
        return self.beta > 0 or self.kl_coef > 0


@dataclass
class ERSConfig:
    # ERS (§2): smoothed per-prompt (m_q, v_q) replace the group's (μ, s²), for a method of GROUP_BASELINES
    enabled: bool = False
    alpha: float = 0.99                 # a, weight of the current group in the EMA (1 = plain GRPO)


@dataclass
class PPSConfig:
    enabled: bool = False               # PPS (§3): prioritized prompt sampling with IS weights
    alpha: float = 0.6                  # α, priority exponent p_q = (mean|A| + ε_p)^α (0 = uniform)
    beta: float = 0.4                   # β, IS-weight exponent w = (N·P)^-β at the first step
    beta_end: float = -1.0              # β at the last step, linear from `beta` (-1 = keep β constant)
    eps: float = 1e-6                   # ε_p, keeps every prompt's priority above zero
    mode: str = "paper"                 # paper (§3, the options below) | released (§3a, the released code)
    # |A^GRPO| statistic mean_abs | max_abs | last_abs, or from Beta counts learnability | thompson (§3b) |
    # single_stream (§10)
    priority: str = "mean_abs"
    is_norm: str = "batch_max"          # IS weights divided by their batch max | batch mean | none (§3b)
    uniform_mix: float = 0.0            # u: P' = (1-u)·P + u/N, no prompt below u/N (§3b)
    posterior_decay: float = 0.9        # λ of the Beta counts at a visit: a <- λa + Σr̂, b <- λb + Σ(1-r̂)
    prior_reversion: float = 0.0        # r: each step a <- 1 + (1-r)(a-1), b likewise, toward the prior (§3b)
    skip: bool = False                  # skip prompts whose last k groups had zero variance (§3b)
    skip_rho: float = 0.5               # ρ: such a prompt is kept with probability max(ρ^k, skip_min)
    skip_min: float = 0.01              # s_min
    replacement: bool = False           # B independent draws from P' (PER's), for which (N·P')^-β is exact (§3b)


@dataclass
class OptimConfig:
    lr: float = 1e-6                    # peak AdamW learning rate
    weight_decay: float = 0.0           # AdamW decoupled weight decay
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    warmup_steps: int = 0               # linear warm-up, in optimizer steps
    min_lr_ratio: float = 0.0           # cosine decays to lr * min_lr_ratio at the last step
    max_grad_norm: float = 1.0          # global grad-norm clip (0 = off)


@dataclass
class TrainConfig:
    output_dir: str = "runs/demo"       # metrics.jsonl, TensorBoard events, checkpoints
    seed: int = 0                       # seeds data order, sampling and init
    max_steps: int = 100                # rollout steps
    # stop after the step at which training has generated this many tokens, evaluated and saved there
    # (0 = no budget; bench/selection.py compares methods at one budget)
    max_generated_tokens: int = 0
    prompts_per_step: int = 64          # B, global prompts per step (split over ranks)
    micro_batch_size: int = 64          # sequences per forward/backward on one rank
    micro_batch_tokens: int = 0         # > 0: token-budget micro-batches of at most this many padded tokens
    packing: bool = True                # with micro_batch_tokens: sequences back to back in one row, no padding
    # scoring's attention kernels, chosen once at start-up: auto (probed: varlen for packed rows on CUDA in
    # bf16, else sdpa per sequence; sdpa flash, efficient, else math) | varlen | flash | efficient | math | cudnn
    attention: str = "auto"
    # compile each decoder layer for scoring and the update: auto (CUDA only) | always | never; a failed
    # compile runs the layers eagerly with one warning and the compile_fallbacks metric (compiled.py)
    compile: str = "auto"
    eval_steps: int = 0                 # evaluate every N steps (0 = only before/after)
    save_steps: int = 0                 # checkpoint every N steps (0 = only at the end)
    keep_checkpoints: int = 2           # newest checkpoints kept (0 = keep all)
    resume: str = ""                    # "" (fresh), "auto" (latest in output_dir), or a path
    progress: bool = True               # tqdm bar on rank 0
    # where metrics go besides metrics.jsonl: tensorboard, wandb (Weights & Biases, if installed), both
    # (tensorboard,wandb) or none
    report_to: str = "tensorboard"
    wandb_project: str = "pspo"         # the W&B project of report_to: wandb
    # stop at start-up when the memory plan (plan.py) says the GPU is too small
    memory_check: bool = True


@dataclass
class EvalConfig:
    num_samples: int = 0                # k for mean@k sampled accuracy (0 = greedy only)
    temperature: float = 0.6            # sampling temperature for mean@k
    top_p: float = 0.95                 # nucleus mass for mean@k
    batch_size: int = 256               # prompts per generate call
    output: str = ""                    # eval.py writes its results here as JSON ("" = no file)


@dataclass
class SPOConfig:
    """SPO, docs/related.md §B: only with algo.advantage spo_chain (the first two) or spo_tree (the rest)."""
    # chain: K, every K-th token with p_t < 0.9 is a cut ("int5"; §B chain 3)
    cutpoint_interval: int = 5
    # chain: N continuations per cut state, V(c) = their mean reward (9 rho-1.1B, 4 long CoT)
    num_mc: int = 9
    # tree: "b0,b1,b2", children per node at depths 0, 1, 2; b0 = rollout.num_generations
    branching: str = "6,6,6"
    # tree: M, the most new tokens of a depth-0 / depth-1 segment ("M0,M1" apart); depth 2 runs to
    # rollout.max_new_tokens (30 rho GSM8K, 100 MATH, 600 R1-Distill)
    segment_tokens: str = "30"
    # tree: A(n) / (population std of the siblings' V + 1e-8), the released code's "grpo" option
    tree_scale: bool = False
    # tree: an edge is trained within this many steps of its tree's growth, else dropped (§B tree 5)
    replay_iterations: int = 8
    # tree: at most this many of a question's buffered edges drawn (and removed) per step
    edges_per_question: int = 32
    # tree: at most this many drawn edges trained per step, a random subset (0 = all; the released code: 512)
    edges_per_step: int = 0

    @property
    def branch_factors(self) -> tuple[int, ...]:
        """(b0, b1, b2), once validated."""
        return parse_ints(self.branching)

    @property
    def segments(self) -> tuple[int, int]:
        """(M0, M1): the token budgets of the depth-0 and depth-1 segments, once validated."""
        m = parse_ints(self.segment_tokens) or (0,)
        return (m[0], m[-1])


CHAIN_KEYS = ("cutpoint_interval", "num_mc")     # the rest of SPOConfig is the tree's


def validate_spo(s: SPOConfig, advantage: str, r: Any, pps_enabled: bool) -> None:
    """The spo section (docs/related.md §B) beside algo.advantage, the rollout section `r` and
    pps.enabled: its chain keys only with spo_chain, its tree keys only with spo_tree, the tree's
    shape consistent with the rollout section, and neither PPS nor the IS correction with the tree.
    Raises ConfigError (one line)."""
    default = SPOConfig()
    for f in dataclasses.fields(SPOConfig):
        owner = "spo_chain" if f.name in CHAIN_KEYS else "spo_tree"
        value = getattr(s, f.name)
        check(advantage == owner or value == getattr(default, f.name), f"spo.{f.name}",
              f"{getattr(default, f.name)!r} (unset) unless algo.advantage={owner}", value)
    if advantage == "spo_chain":
        check(s.cutpoint_interval >= 1, "spo.cutpoint_interval", ">= 1", s.cutpoint_interval)
        check(s.num_mc >= 1, "spo.num_mc", ">= 1", s.num_mc)
    if advantage != "spo_tree":
        return
    # Refused: PPS's IS weight belongs to the step its prompt was drawn, but a tree's edges are
    # trained over the next spo.replay_iterations steps, mixed with other steps' prompts.
    check(not pps_enabled, "pps.enabled", "false with algo.advantage=spo_tree (its edges are replayed in "
          "later steps, where the drawing step's IS weights do not apply)", pps_enabled)
    check(r.is_correction == "none", "rollout.is_correction", "none with algo.advantage=spo_tree (its "
          "replayed tree edges keep no engine log-probs)", r.is_correction)
    b, m = s.branch_factors, parse_ints(s.segment_tokens)
    check(len(b) == 3 and min(b) >= 1, "spo.branching", "three positive integers b0,b1,b2 (e.g. 6,6,6)",
          s.branching)
    check(r.num_generations == b[0], "rollout.num_generations", f"spo.branching's b0 = {b[0]} with "
          "algo.advantage=spo_tree (the root's children are the prompt's G completions)", r.num_generations)
    check(len(m) in (1, 2) and min(m) >= 1, "spo.segment_tokens", "one positive integer M, or two M0,M1",
          s.segment_tokens)
    check(sum(s.segments) < r.max_new_tokens, "spo.segment_tokens", f"M0 + M1 < rollout.max_new_tokens = "
          f"{r.max_new_tokens} (depth 2 continues to max_new_tokens)", s.segment_tokens)
    check(s.replay_iterations >= 1, "spo.replay_iterations", ">= 1 (1 = no replay)", s.replay_iterations)
    check(s.edges_per_question >= 1, "spo.edges_per_question", ">= 1", s.edges_per_question)
    check(s.edges_per_step >= 0, "spo.edges_per_step", ">= 0 (0 = every drawn edge)", s.edges_per_step)


RHOS = ("kl", "constant")                       # single_stream.rho


@dataclass
class SingleStreamConfig:
    """Single-stream PO's value tracker, docs/methods.md §10: only with algo.advantage=single_stream. The defaults
    are the authors' verl recipe's (recipe/spo: spo_trainer.yaml, spo_ray_trainer.py)."""
    # the tracker's decay ρ per visit: kl (2^(-D/d_half) clipped to [rho_min, rho_max], D the drift of the prompt's
    # last completion since its last visit) | constant (rho_value)
    rho: str = "kl"
    rho_value: float = 0.875            # ρ with rho=constant
    rho_min: float = 0.875              # ρ_min; also N_init = 1/(1 - ρ_min), the offline prior's weight
    rho_max: float = 0.96               # ρ_max, the decay of a first visit (D = 0)
    d_half: float = 0.06                # D_half: the drift D (mean |Δ log π| per token) at which ρ = 1/2
    # JSON {problem text: [offline rewards]} for the prior α0, β0 ("" = α0 = β0 = 0.5 for every prompt)
    prior_file: str = ""
    prior_samples: int = 8              # N_eff: at most this many of a prompt's offline rewards are counted


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    prm: PRMConfig = field(default_factory=PRMConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    ers: ERSConfig = field(default_factory=ERSConfig)
    pps: PPSConfig = field(default_factory=PPSConfig)
    spo: SPOConfig = field(default_factory=SPOConfig)
    single_stream: SingleStreamConfig = field(default_factory=SingleStreamConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


ENGINES, BAD_GOLD = ("auto", "vllm", "hf"), ("skip", "error")
# model.gradient_checkpointing: the modes in order of recompute cost, then auto (plan.py picks the first that fits)
CHECKPOINTING = ("none", "selective", "full", "auto")
CHECKPOINTING_ALIASES = {"true": "full", "false": "none"}     # the field was a boolean
COMPILES = ("auto", "always", "never")      # rollout.compile, resolved by rollout.compile_enabled
REPORT_TO = ("tensorboard", "wandb", "none")  # train.report_to, comma-separated
ATTENTIONS = ("auto", "varlen", "flash", "efficient", "math", "cudnn")   # train.attention: packed_attention.py
LOGPROB_HEADS = ("auto", "eager", "compiled")          # model.logprob_head: model.head_mode, token_logprobs.py


def _coerce(key: str, value: Any, typ: str) -> Any:
    """Check/convert one value to the field's annotated type (YAML values and CLI strings)."""
    if typ == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
    elif typ == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif typ == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif typ == "str":
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{key}: expected {typ}, got {value!r}")


# keys that are gone, and what replaced them (a config that still sets one gets this line, not "unknown key")
REMOVED = {"rollout.sync_check_tol": "removed: the sync check compares exact per-row weight checksums, with no "
                                     "tolerance (docs/gpu.md, Sync check); delete the key"}


def _set(cfg: Config, key: str, value: Any) -> None:
    if key in REMOVED:
        raise ConfigError(f"{key}: {REMOVED[key]}")
    section, _, name = key.partition(".")
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section not in sections or not name:
        raise ConfigError(f"{key}: unknown section, expected one of {', '.join(sections)}")
    sub = getattr(cfg, section)
    while True:                                  # model.lora.rank: a section's sub-section
        name, _, rest = name.partition(".")
        fields = {f.name: f for f in dataclasses.fields(sub)}
        if name not in fields:
            raise ConfigError(f"{key[:len(key) - len(rest) - bool(rest)]}: unknown key, expected one of "
                              f"{', '.join(fields)}")
        if not dataclasses.is_dataclass(getattr(sub, name)):
            break
        if not rest and isinstance(value, dict):                  # YAML: lora: {rank: 16, ...}
            for inner, v in value.items():
                _set(cfg, f"{key}.{inner}", v)
            return
        if not rest:
            raise ConfigError(f"{key}: expected a mapping of key: value, got {value!r}")
        sub, name = getattr(sub, name), rest
    if rest:
        raise ConfigError(f"{key}: {key[:len(key) - len(rest) - 1]} has no sub-keys")
    if key == "model.gradient_checkpointing":                    # YAML true / false, "true" / "false"
        value = CHECKPOINTING_ALIASES.get(str(value).lower(), value)
    setattr(sub, name, _coerce(key, value, str(fields[name].type)))


def _read_yaml(path: str, seen: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Read a YAML config, following `base:` links; later files override earlier ones."""
    if not os.path.isfile(path):
        renamed = RENAMED_PRESETS.get(os.path.basename(path))
        raise ConfigError(f"config file not found: {path}" + (f" (the preset is now {renamed}: {RENAMED_VALUE})"
                                                              if renamed else ""))
    if os.path.abspath(path) in seen:
        raise ConfigError(f"{path}: `base:` cycle")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({first_line(e)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    merged: dict[str, dict[str, Any]] = {}
    base = raw.pop("base", None)
    if base is not None:
        merged = _read_yaml(os.path.join(os.path.dirname(path), str(base)), seen + (os.path.abspath(path),))
    for section, values in raw.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: section `{section}` must be a mapping of key: value")
        merged.setdefault(section, {}).update(values)
    return merged


def load_config(path: str | None, overrides: list[str] = (), world_size: int = 1) -> Config:
    """Defaults <- YAML file (if any) <- `--section.key=value` overrides; then validate."""
    cfg = Config()
    if path:
        for section, values in _read_yaml(path).items():
            for name, value in values.items():
                _set(cfg, f"{section}.{name}", value)
    for item in overrides:
        if not item.startswith("--") or "=" not in item:
            raise ConfigError(f"{item}: overrides look like --section.key=value")
        key, _, value = item[2:].partition("=")
        _set(cfg, key, value)
    validate(cfg, world_size)
    return cfg


def validate(cfg: Config, world_size: int = 1) -> None:
    """Impossible values and combinations, each reported as one line naming the key."""
    r, a, t, o = cfg.rollout, cfg.algo, cfg.train, cfg.optim
    check(r.engine in ENGINES, "rollout.engine", " | ".join(ENGINES), r.engine)
    check(r.num_generations >= 2 or (r.num_generations == 1 and a.advantage == "single_stream"),
          "rollout.num_generations", "G >= 2 (a group needs two samples; G = 1 is algo.advantage=single_stream's "
          "alone)", r.num_generations)
    check(r.temperature > 0, "rollout.temperature", "> 0", r.temperature)
    check(0 < r.top_p <= 1, "rollout.top_p", "in (0, 1]", r.top_p)
    check(r.max_new_tokens >= 1, "rollout.max_new_tokens", ">= 1", r.max_new_tokens)
    check(r.batch_size >= 1, "rollout.batch_size", ">= 1", r.batch_size)
    check(r.compile in COMPILES, "rollout.compile", " | ".join(COMPILES), r.compile)
    check(0 < r.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "in (0, 1]",
           r.gpu_memory_utilization)
    check(r.sync_check_steps >= 0, "rollout.sync_check_steps", ">= 0", r.sync_check_steps)
    corrected = r.is_correction != "none"
    check(r.is_correction in IS_CORRECTIONS, "rollout.is_correction", " | ".join(IS_CORRECTIONS),
           r.is_correction)
    check(1 < r.is_cap < math.inf, "rollout.is_cap", "a finite number > 1 (C caps π_old/π_engine)",
           r.is_cap)
    check(0 <= r.is_floor < 1, "rollout.is_floor", "a number in [0, 1) (C_low, the lower bound of "
          "π_old/π_engine)", r.is_floor)
    check(r.is_floor == 0 or r.is_correction != "none", "rollout.is_floor", "0 with rollout.is_correction=none "
          "(there is no ratio to bound)", r.is_floor)
    check(not corrected or r.top_p == 1, "rollout.top_p", f"1 with rollout.is_correction={r.is_correction} "
           "(below 1 vLLM reports log-probs renormalised over the nucleus: docs/methods.md §7)", r.top_p)
    check(a.aggregation in AGGREGATIONS, "algo.aggregation", " | ".join(AGGREGATIONS), a.aggregation)
    check(a.beta >= 0, "algo.beta", ">= 0", a.beta)
    check(0 <= a.eps_low <= 1, "algo.eps_low", "in [0, 1] (1: no lower bound)", a.eps_low)
    check(a.eps_high >= 0, "algo.eps_high", ">= 0", a.eps_high)
    check(a.num_iterations >= 1, "algo.num_iterations", ">= 1", a.num_iterations)
    check(a.adv_eps > 0, "algo.adv_eps", "> 0", a.adv_eps)
    check(a.kl_coef >= 0, "algo.kl_coef", ">= 0", a.kl_coef)
    check(a.clip_score > 0, "algo.clip_score", "> 0", a.clip_score)
    check(a.whiten in WHITENINGS, "algo.whiten", " | ".join(WHITENINGS), a.whiten)
    validate_method(cfg)
    validate_objective(cfg)
    check(0 < cfg.ers.alpha <= 1, "ers.alpha", "in (0, 1]", cfg.ers.alpha)
    p = cfg.pps
    check(p.alpha >= 0, "pps.alpha", ">= 0", p.alpha)
    check(p.beta >= 0, "pps.beta", ">= 0", p.beta)
    check(p.beta_end == -1 or p.beta_end >= 0, "pps.beta_end", ">= 0, or -1 for a constant β", p.beta_end)
    check(p.eps > 0, "pps.eps", "> 0", p.eps)
    check(p.priority != "posterior", "pps.priority", "learnability, the name of the p̂(1-p̂) priority once called "
          "posterior (docs/methods.md §3b)", p.priority)
    check(p.priority in PRIORITIES, "pps.priority", " | ".join(PRIORITIES), p.priority)
    check(p.is_norm in IS_NORMS, "pps.is_norm", " | ".join(IS_NORMS), p.is_norm)
    if p.mode == "reference":
        raise ConfigError(f"pps.mode: {RENAMED_VALUE}")
    check(p.mode in PPS_MODES, "pps.mode", " | ".join(PPS_MODES), p.mode)
    check(0 <= p.uniform_mix < 1, "pps.uniform_mix", "in [0, 1)", p.uniform_mix)
    check(0 < p.posterior_decay <= 1, "pps.posterior_decay", "in (0, 1]", p.posterior_decay)
    check(0 <= p.prior_reversion < 1, "pps.prior_reversion", "in [0, 1)", p.prior_reversion)
    check(p.prior_reversion == 0 or p.priority in BETA_PRIORITIES, "pps.prior_reversion", "0 with pps.priority="
          f"{p.priority} (it moves the Beta counts of {' | '.join(BETA_PRIORITIES)})", p.prior_reversion)
    check(0 < p.skip_rho <= 1, "pps.skip_rho", "in (0, 1]", p.skip_rho)
    check(0 < p.skip_min <= 1, "pps.skip_min", "in (0, 1]", p.skip_min)
    check(not (p.replacement and p.skip), "pps.replacement", "false with pps.skip (a skipped prompt is replaced "
          "among the distinct ones)", p.replacement)
    if p.mode == "released":                     # §3a is one fixed procedure: the §3b options do not apply
        paper_only = {"beta_end": -1.0, "priority": "mean_abs", "is_norm": "batch_max", "uniform_mix": 0.0,
                      "skip": False, "eps": 1e-6, "replacement": False}
        for key, default in paper_only.items():
            check(getattr(p, key) == default, f"pps.{key}", f"{default} (unset) with pps.mode=released, "
                   "the released code's fixed procedure (docs/methods.md §3a)", getattr(p, key))
    check(o.lr > 0 and math.isfinite(o.lr), "optim.lr", "a finite number > 0", o.lr)
    check(o.warmup_steps >= 0, "optim.warmup_steps", ">= 0", o.warmup_steps)
    check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "in [0, 1]", o.min_lr_ratio)
    check(o.max_grad_norm >= 0, "optim.max_grad_norm", ">= 0", o.max_grad_norm)
    check(t.max_steps >= 1, "train.max_steps", ">= 1", t.max_steps)
    check(t.max_generated_tokens >= 0, "train.max_generated_tokens", ">= 0 (0 = no token budget)",
          t.max_generated_tokens)
    check(t.prompts_per_step >= world_size and t.prompts_per_step % world_size == 0,
           "train.prompts_per_step", f"a multiple of the {world_size} ranks", t.prompts_per_step)
    check(t.micro_batch_size >= 1, "train.micro_batch_size", ">= 1", t.micro_batch_size)
    check(t.micro_batch_tokens >= 0, "train.micro_batch_tokens", ">= 0 (0 = fixed micro_batch_size)",
           t.micro_batch_tokens)
    check(t.attention in ATTENTIONS, "train.attention", " | ".join(ATTENTIONS), t.attention)
    check(t.compile in COMPILES, "train.compile", " | ".join(COMPILES), t.compile)
    check(cfg.model.logprob_head in LOGPROB_HEADS, "model.logprob_head", " | ".join(LOGPROB_HEADS),
          cfg.model.logprob_head)
    for key in ("eval_steps", "save_steps", "keep_checkpoints"):
        check(getattr(t, key) >= 0, f"train.{key}", ">= 0", getattr(t, key))
    weights = {k: getattr(cfg.reward, k) for k in ("accuracy", "format", "cosine", "knights", "prm")}
    for key, weight in weights.items():
        check(math.isfinite(weight), f"reward.{key}", "a finite weight", weight)
    check(any(w != 0 for w in weights.values()), "reward", "at least one non-zero weight", weights)
    check(cfg.reward.timeout_s > 0, "reward.timeout_s", "> 0", cfg.reward.timeout_s)
    check(cfg.reward.workers >= -1, "reward.workers", ">= 0 processes, or -1 for auto (the cores left after "
           "the training threads)", cfg.reward.workers)
    validate_prm(cfg.prm, cfg.reward.prm)
    validate_random_reward(cfg)
    check(cfg.eval.num_samples >= 0, "eval.num_samples", ">= 0", cfg.eval.num_samples)
    check(cfg.eval.temperature > 0, "eval.temperature", "> 0", cfg.eval.temperature)
    check(0 < cfg.eval.top_p <= 1, "eval.top_p", "in (0, 1]", cfg.eval.top_p)
    # 0 = all for the two example caps
    for key, low in (("max_eval_examples", 0), ("max_train_examples", 0), ("max_prompt_tokens", 1)):
        check(getattr(cfg.data, key) >= low, f"data.{key}", f">= {low}", getattr(cfg.data, key))
    sizes = parse_ints(cfg.data.train_people)
    all_people = not str(cfg.data.train_people).strip()
    check(all_people or (sizes and all(2 <= n <= 8 for n in sizes)), "data.train_people",
           'K&K numbers of people in 2..8, comma-separated (e.g. "2,3,4"), or "" for all',
           cfg.data.train_people)
    # one word that is not a name is a mistyped name ("R1"), not a prompt
    prompt = cfg.data.system_prompt.strip()
    check(not prompt or prompt in SYSTEM_PROMPTS or any(c.isspace() for c in prompt), "data.system_prompt",
           f"a prompt name ({', '.join(SYSTEM_PROMPTS)}), the text of a system message (words with spaces) "
           "or \"\"", cfg.data.system_prompt)
    check(cfg.data.bad_gold in BAD_GOLD, "data.bad_gold", " | ".join(BAD_GOLD), cfg.data.bad_gold)
    check(cfg.model.logprob_chunk_tokens >= 1, "model.logprob_chunk_tokens", ">= 1",
           cfg.model.logprob_chunk_tokens)
    check(cfg.model.gradient_checkpointing in CHECKPOINTING, "model.gradient_checkpointing",
          " | ".join(CHECKPOINTING) + " (or true / false: full / none)", cfg.model.gradient_checkpointing)
    sinks = report_sinks(t.report_to)
    check(set(sinks) <= set(REPORT_TO) and ("none" not in sinks or sinks == ["none"]), "train.report_to",
          "tensorboard, wandb, tensorboard,wandb or none", t.report_to)
    check("wandb" not in sinks or importlib.util.find_spec("wandb") is not None, "train.report_to",
          "wandb installed to report to it (pip install wandb)", t.report_to)
    lo = cfg.model.lora
    check(lo.rank >= 0, "model.lora.rank", ">= 0 (0 = full fine-tuning)", lo.rank)
    check(lo.alpha > 0 and math.isfinite(lo.alpha), "model.lora.alpha", "a finite number > 0", lo.alpha)
    # dropout acts in the update (train mode) but not when π_old is scored (eval mode): ρ != 1 at the first
    # iteration. Dropout is off everywhere else (model.disable_dropout), as in RL fine-tuning codes.
    check(lo.dropout == 0, "model.lora.dropout", "0 (π_old is scored without dropout; with it the update's "
          "ratio π/π_old would not be 1 at the first iteration)", lo.dropout)
    names = [] if lo.targets == "all-linear" else lo.targets
    check(lo.targets == "all-linear" or (all(n.isidentifier() for n in names) and names),
          "model.lora.target_modules", "all-linear or module names separated by commas (q_proj,v_proj)",
          lo.target_modules)
    # the log-prob head reads lm_head's weight itself (token_logprobs.py): an adapter there would be ignored
    check(not {"lm_head", "embed_tokens", "wte", "word_embeddings"} & set(names), "model.lora.target_modules",
          "decoder layers only (the output head and the embeddings are not adapted)", lo.target_modules)


def validate_method(cfg: Config) -> None:
    """The settings that belong to one advantage method: the one place validation reads
    algo.advantage (methods.method_for picks the function, plan.step_shape counts what it generates)."""
    a = cfg.algo
    check(a.advantage in ADVANTAGES, "algo.advantage", " | ".join(ADVANTAGES), a.advantage)
    if a.advantage in ("reinforce_pp", "reinforce_pp_baseline"):
        check(a.beta == 0, "algo.beta", f"0 with algo.advantage={a.advantage} (REINFORCE++ has no KL loss "
               "term; its KL is in the reward, algo.kl_coef)", a.beta)
    else:
        check(a.kl_coef == 0, "algo.kl_coef", f"0 with algo.advantage={a.advantage} (the KL in the reward "
               "is REINFORCE++'s; here the KL is the loss term algo.beta)", a.kl_coef)
    check(a.advantage != "rloo" or not a.scale_rewards, "algo.scale_rewards", "false with algo.advantage=rloo "
          "(divided by the group std, RLOO's advantage is GRPO's times G/(G-1), a constant that AdamW's update "
          "cancels: RLOO in name only; algo.advantage=grpo is that run, docs/methods.md §1)", a.scale_rewards)
    if a.advantage == "maxrl":                    # it divides by the group's mean reward, its success rate
        for key in ("cosine", "knights", "overlong_cache"):
            check(getattr(cfg.reward, key) == 0, f"reward.{key}", "0 with algo.advantage=maxrl (it divides by the "
                  "group's mean reward, which needs rewards >= 0; this one can be negative)", getattr(cfg.reward, key))
        for key in ("accuracy", "format", "prm"):
            check(getattr(cfg.reward, key) >= 0, f"reward.{key}", ">= 0 with algo.advantage=maxrl (it divides by "
                  "the group's mean reward, which needs rewards >= 0)", getattr(cfg.reward, key))
    check(not cfg.ers.enabled or a.advantage in GROUP_BASELINES, "ers.enabled", f"false with algo.advantage="
          f"{a.advantage} (ERS smooths a group baseline's mean and std: {', '.join(GROUP_BASELINES)} have one, "
          f"{a.advantage} has none)", cfg.ers.enabled)
    validate_dapo(cfg)
    validate_spo(cfg.spo, a.advantage, cfg.rollout, cfg.pps.enabled)
    validate_single_stream(cfg)
    validate_async(cfg)


def validate_objective(cfg: Config) -> None:
    """algo.objective (docs/methods.md §11) beside the method and the IS correction, each refusal saying why."""
    a, r = cfg.algo, cfg.rollout
    check(a.objective in OBJECTIVES, "algo.objective", " | ".join(OBJECTIVES), a.objective)
    if a.objective == "gspo":                     # one ratio per completion: one advantage, one weight per completion
        check(a.advantage not in TOKEN_ADVANTAGES, "algo.objective", f"gspo_token with algo.advantage={a.advantage} "
              "(its advantages are per token; gspo's one ratio per completion would average them)", a.objective)
        check(r.is_correction not in ("token", "token_mask"), "rollout.is_correction", "none | sequence | "
              "sequence_mask | geo_mask with algo.objective=gspo (one weight per completion for its one ratio: a "
              "per-token weight would still pass the dropped token's gradient through s_i; per-token weights: "
              "algo.objective=gspo_token)", r.is_correction)
    default = AlgoConfig()
    for key in ("sapo_tau_pos", "sapo_tau_neg"):
        value = getattr(a, key)
        check(0 < value < math.inf, f"algo.{key}", "a finite number > 0", value)
        check(a.objective == "sapo" or value == getattr(default, key), f"algo.{key}",
              f"{getattr(default, key)} (unset) unless algo.objective=sapo", value)
    if a.objective == "sapo":                     # its soft gate replaces the clip
        for key in ("eps_low", "eps_high"):
            check(getattr(a, key) == getattr(default, key), f"algo.{key}", f"{getattr(default, key)} (unset) with "
                  "algo.objective=sapo (its soft gate has no clip; its temperatures are algo.sapo_tau_pos, "
                  "algo.sapo_tau_neg)", getattr(a, key))


def validate_dapo(cfg: Config) -> None:
    """DAPO's parts (docs/methods.md §9) beside algo.advantage: each with any method, refused where it
    has no meaning."""
    r, a, cache = cfg.rollout, cfg.algo.advantage, cfg.reward.overlong_cache
    check(r.max_sampling_rounds >= 1, "rollout.max_sampling_rounds", ">= 1 (the first round included)",
          r.max_sampling_rounds)
    default_rounds = RolloutConfig.max_sampling_rounds
    check(r.dynamic_sampling or r.max_sampling_rounds == default_rounds, "rollout.max_sampling_rounds",
          f"{default_rounds} (the default) with rollout.dynamic_sampling=false (there are no extra rounds)",
          r.max_sampling_rounds)
    check(not r.dynamic_sampling or a != "spo_tree", "rollout.dynamic_sampling", "false with algo.advantage="
          "spo_tree (it trains edges replayed from earlier steps, not the step's groups)", r.dynamic_sampling)
    check(not cfg.algo.overlong_filter or a != "spo_tree", "algo.overlong_filter", "false with algo.advantage="
          "spo_tree (it trains tree edges, which keep no truncation flag)", cfg.algo.overlong_filter)
    check(0 <= cache < r.max_new_tokens, "reward.overlong_cache", f"L_cache in [0, rollout.max_new_tokens = "
          f"{r.max_new_tokens}) tokens (0 = off)", cache)
    check(cache == 0 or a not in ("spo_chain", "spo_tree"), "reward.overlong_cache", f"0 with algo.advantage={a} "
          "(its continuations are scored from their text alone, without their token counts)", cache)


REWARD_KINDS = ("verified", "random")


def validate_random_reward(cfg: Config) -> None:
    """reward.kind=random, the control of docs/methods.md §5: the accuracy's term alone, replaced by a Bernoulli
    draw at reward.random_rate; every other reward refused, so that the training reward is that draw."""
    r = cfg.reward
    check(r.kind in REWARD_KINDS, "reward.kind", " | ".join(REWARD_KINDS), r.kind)
    if r.kind != "random":
        check(r.random_rate == 0, "reward.random_rate", "0 (unset) with reward.kind=verified", r.random_rate)
        return
    check(0 < r.random_rate < 1, "reward.random_rate", "the task's measured base rate in (0, 1) with reward.kind="
          "random (the logged accuracy of one step over the train set: docs/methods.md §5)", r.random_rate)
    check(r.accuracy != 0, "reward.accuracy", "a non-zero weight with reward.kind=random (the random reward "
          "replaces the accuracy's term)", r.accuracy)
    for key in ("format", "cosine", "knights", "prm", "overlong_cache"):
        check(getattr(r, key) == 0, f"reward.{key}", "0 with reward.kind=random (the control's reward is the "
              "random draw alone)", getattr(r, key))
    check(cfg.algo.advantage not in ("spo_chain", "spo_tree"), "reward.kind", f"verified with algo.advantage="
          f"{cfg.algo.advantage} (its continuations are scored by the verifier inside the step)", r.kind)


ROLLOUT_MODES = ("sync", "async")


def validate_async(cfg: Config) -> None:
    """rollout.mode=async (docs/methods.md §7b): its keys, and the settings it refuses, each saying why. The
    devices (engine_gpus, engine_cores) are checked against the machine at start-up (engines/schedule.py)."""
    r, a = cfg.rollout, cfg.algo.advantage
    check(r.mode in ROLLOUT_MODES, "rollout.mode", " | ".join(ROLLOUT_MODES), r.mode)
    check(r.lag in (0, 1), "rollout.lag", "0 or 1 (a fixed lag of one step; 0 runs the synchronous schedule "
          "through the engine processes)", r.lag)
    check(r.engines >= 1, "rollout.engines", ">= 1", r.engines)
    check(0 < r.engine_timeout_s < 600, "rollout.engine_timeout_s", "in (0, 600) seconds (at 600 the process "
          "group's own time-out would end the other ranks first)", r.engine_timeout_s)
    for key, value in (("rollout.engine_gpus", r.engine_gpus), ("rollout.engine_cores", r.engine_cores)):
        check(not value or parse_ints(value), key, "integers separated by commas, or empty", value)
    if r.mode != "async":
        return
    # per token or geometric: a sequence-level ratio is the product of a whole optimizer step's change over the
    # completion's tokens (§7b), which caps or drops nearly every completion; their geometric mean does not grow
    check(r.lag == 0 or r.is_correction in ("geo_mask", "token", "token_mask"), "rollout.is_correction", "geo_mask "
          "| token | token_mask with rollout.mode=async at rollout.lag=1 (the completions come from θ_{s-1}: without "
          "the IS weight the update is the gradient of another policy, and a sequence-level one, the product of a "
          "whole step's change over a completion's tokens, caps or drops nearly every completion; geo_mask's "
          "geometric mean does not grow with the length)", r.is_correction)
    check(a not in ("spo_chain", "spo_tree"), "algo.advantage", "not spo_chain / spo_tree with rollout.mode=async "
          "(their Monte Carlo continuations are generated inside the step and must come from π_old)", a)
    check(not r.dynamic_sampling, "rollout.dynamic_sampling", "false with rollout.mode=async (its extra rounds are "
          "drawn inside the step from the rewards just seen, which would need the engines mid-step)",
          r.dynamic_sampling)
    check(not r.sleep, "rollout.sleep", "false with rollout.mode=async (a sleeping engine cannot generate "
          "during the update)", r.sleep)
    gpus = parse_ints(r.engine_gpus) if r.engine_gpus else ()
    check(not gpus or len(gpus) == r.engines, "rollout.engine_gpus", f"one CUDA index per engine "
          f"(rollout.engines={r.engines})", r.engine_gpus)
    check(len(set(gpus)) == len(gpus), "rollout.engine_gpus", "distinct indices", r.engine_gpus)


def validate_single_stream(cfg: Config) -> None:
    """The single_stream section (docs/methods.md §10) beside algo.advantage, and what a group of one
    (rollout.num_generations = 1, Single-stream PO's default, `validate` allows it with that method alone)
    refuses, each saying why."""
    s, r, p, a = cfg.single_stream, cfg.rollout, cfg.pps, cfg.algo.advantage
    chosen = a == "single_stream"
    default = SingleStreamConfig()
    for f in dataclasses.fields(SingleStreamConfig):
        value = getattr(s, f.name)
        check(chosen or value == getattr(default, f.name), f"single_stream.{f.name}",
              f"{getattr(default, f.name)!r} (unset) unless algo.advantage=single_stream", value)
    check(not chosen or cfg.algo.scale_rewards, "algo.scale_rewards", "true with algo.advantage=single_stream (its "
          "advantages are always normalised over the batch, docs/methods.md §10)", cfg.algo.scale_rewards)
    check(not (chosen and r.dynamic_sampling), "rollout.dynamic_sampling", "false with algo.advantage=single_stream "
          "(it sets aside groups by their spread, and the tracker would never see their rewards)", r.dynamic_sampling)
    if r.num_generations == 1 and p.enabled:      # a group of one has |A| = 0: only the Beta counts mean anything
        check(p.mode == "paper", "pps.mode", "paper with rollout.num_generations=1 (the released code's priority "
              "is the |A| of a group, 0 for a group of one)", p.mode)
        check(p.priority in BETA_PRIORITIES, "pps.priority", f"{' | '.join(BETA_PRIORITIES)} with "
              "rollout.num_generations=1 (the |A| of a group of one is 0)", p.priority)
        check(not p.skip, "pps.skip", "false with rollout.num_generations=1 (every group of one has zero variance)",
              p.skip)
    check(s.rho in RHOS, "single_stream.rho", " | ".join(RHOS), s.rho)
    check(0 < s.rho_value <= 1, "single_stream.rho_value", "in (0, 1]", s.rho_value)
    check(0 < s.rho_min < 1, "single_stream.rho_min", "in (0, 1) (N_init = 1/(1 - rho_min))", s.rho_min)
    check(s.rho_min <= s.rho_max <= 1, "single_stream.rho_max", f"in [rho_min = {s.rho_min}, 1]", s.rho_max)
    check(s.d_half > 0, "single_stream.d_half", "> 0", s.d_half)
    check(s.prior_samples >= 1, "single_stream.prior_samples", ">= 1", s.prior_samples)
    check(not s.prior_file or os.path.isfile(s.prior_file), "single_stream.prior_file", "a JSON file of "
          "{problem: [offline rewards]}, or \"\" for the prior 0.5, 0.5", s.prior_file)


def validate_prm(p: PRMConfig, weight: float) -> None:
    """The prm section (docs/related.md §C); a model is required only when reward.prm weighs it."""
    check(weight == 0 or bool(p.model.strip()), "prm.model", "a sequence-classifier folder or hub id (or "
           f"builtin:tiny-prm) with reward.prm={weight:g}", p.model)
    check(p.label >= 0, "prm.label", ">= 0 (the index of the PRM's \"correct\" class)", p.label)
    if p.split == "reference":
        raise ConfigError(f"prm.split: {RENAMED_VALUE}")
    check(p.split in PRM_SPLITS, "prm.split", " | ".join(PRM_SPLITS), p.split)
    check(p.shaping in PRM_SHAPINGS, "prm.shaping", " | ".join(PRM_SHAPINGS), p.shaping)
    check(p.max_tokens >= 8, "prm.max_tokens", ">= 8", p.max_tokens)
    check(p.batch_tokens >= p.max_tokens, "prm.batch_tokens", f">= prm.max_tokens = {p.max_tokens}",
           p.batch_tokens)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str) -> None:
    """Write the resolved config (every field, after overrides) as YAML."""
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)

