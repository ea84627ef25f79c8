"""The transformers engine: generation with the training model itself (`HFEngine`).

It runs one of two loops with the same draws: its own static-cache loop (decode.py: a preallocated
KV cache read in length-aware windows, finished rows compacted away, the decoding step compiled
when `rollout.compile` says so), or transformers `generate` with a dynamic cache and the sampler
as a logits processor (under FSDP2, where ranks step together through the sharded root, and as
the baseline the first is tested against). Both draw each token with sampling.py's counter-based Gumbel noise.
"""
from __future__ import annotations

import functools
import time

import torch
from torch import Tensor
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StaticCache

from pspo.engines.decode import Decoder
from pspo.engines.sampling import perturbed_logits
from pspo.training.tokens import Rollout, continuation_inputs, left_pad, stop_token_ids


class _GumbelSampler(LogitsProcessor):
    """Turns greedy decoding into seeded sampling and records log softmax(z/T) of each choice."""

    def __init__(self, seeds: Tensor | None, prompt_len: int, temperature: float, top_p: float):
        self.seeds, self.prompt_len, self.temperature, self.top_p = seeds, prompt_len, temperature, top_p
        self.logprobs: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        t = input_ids.shape[1] - self.prompt_len                            # tokens generated so far
        z, logp = perturbed_logits(scores, self.seeds, t, temperature=self.temperature, top_p=self.top_p)
        choice = z.argmax(dim=-1)                                           # what generate picks
        self.logprobs.append(logp.gather(1, choice[:, None]).squeeze(1))
        return z

HF_LOOPS = ("static", "generate", "generate-static")


class HFEngine:
    """transformers on the training model itself, batched and left-padded.

    loop "static": decode.py's static-cache loop (length-aware windows, finished rows compacted
    away, each row ended at its own budget), its step compiled when `compile` (rows in buckets of
    `batch_size`, cache length a multiple of `max_len`, the longest prompt + max_new_tokens; 0 = each
    call's own). loop "generate": transformers `generate` with a dynamic
    cache ("generate-static": with transformers' own StaticCache of max(max_len, the call's length)
    positions, which `generate` compiles on CUDA; bench/rollout.py compares the three), through the
    `Policy` wrapper's __call__ (model.py) so that, under FSDP2, the root module's parameters are
    gathered; `synced` (FSDP2) forces it and keeps ranks stepping together (a rank that finishes
    early keeps running dummy forwards until all are done).
    """

    def __init__(self, model: torch.nn.Module, tokenizer, batch_size: int, synced: bool = False,
                 compile: bool = False, max_len: int = 0, loop: str = "static"):
        self.model, self.tokenizer, self.batch_size, self.synced = model, tokenizer, batch_size, synced
        self.stop_ids = stop_token_ids(tokenizer, model.lm.generation_config.eos_token_id)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        if loop not in HF_LOOPS:
            raise ValueError(f"loop: expected {' | '.join(HF_LOOPS)}, got {loop!r}")
        self.loop, self.max_len, self.compile = loop, max_len, compile

    @functools.cached_property
    def decoder(self) -> Decoder | None:
        """The static-cache loop (loop "static", one process), built at its first use: its twin's bf16 weight
        copies are made then, so that an engine that never generates (the evaluation engine of an asynchronous
        run without an eval set) holds nothing (docs/gpu.md#plan)."""
        if self.loop != "static" or self.synced:
            return None
        return Decoder(self.model, self.stop_ids, self.pad_id, self.batch_size, self.max_len, self.compile)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int, seeds: Tensor | None,
                 prefix_ids: list[list[int]] | None = None) -> Rollout:
        """n completions per prompt; seeds (len(prompt_ids)*n,) int64, or None for greedy.

        prefix_ids (one per prompt): partial completions to continue, each with at most
        max_new_tokens - len(prefix) new tokens; the Rollout's tensors hold the continuations only
        (its texts the whole completions). The static loop ends each row at its own budget;
        `generate` runs a chunk to its largest and each row is then cut to its own, which changes
        nothing else, since a row's draws depend on its seed alone. The columns past every row's
        end are dropped.
        """
        inputs, budgets = continuation_inputs(prompt_ids, prefix_ids, max_new_tokens)
        per_call = max(1, self.batch_size // n)
        parts = []
        start = time.perf_counter()
        for i in range(0, len(inputs), per_call):
            chunk = inputs[i:i + per_call]
            chunk_seeds = None if seeds is None else seeds[i * n:(i + len(chunk)) * n]
            parts.append(self._generate(chunk, n, temperature, top_p, budgets[i:i + per_call], chunk_seeds))
        gen_time = time.perf_counter() - start
        width = max(p[0].shape[1] for p in parts)
        ids = torch.cat([_pad_right(p[0], width, self.pad_id) for p in parts])
        logprobs = torch.cat([_pad_right(p[1], width, 0.0) for p in parts])
        is_stop = torch.isin(ids, torch.tensor(self.stop_ids, device=ids.device))
        before_stop = (is_stop.cumsum(1) - is_stop.long()) == 0                  # up to the first stop
        budget = torch.tensor(budgets, device=ids.device).repeat_interleave(n)[:, None]   # (N, 1)
        columns = torch.arange(width, device=ids.device)
        mask = before_stop & (columns < _lengths(parts, width)) & (columns < budget)
        truncated = ~(is_stop & mask).any(1)
        width = int(mask.sum(1).max())                     # the longest row's end: past it, padding only
        ids, mask, logprobs = ids[:, :width], mask[:, :width], logprobs[:, :width]
        ids = ids.masked_fill(~mask, self.pad_id)
        prefixes = [q for q in (prefix_ids or [[]] * len(prompt_ids)) for _ in range(n)]
        texts = self.tokenizer.batch_decode([list(q) + row[m].tolist()
                                             for q, row, m in zip(prefixes, ids, mask)],
                                            skip_special_tokens=True)
        return Rollout(ids.cpu(), mask.float().cpu(), (logprobs * mask).cpu(), truncated.cpu(), texts,
                       gen_time)

    def release(self) -> None:
        """The step generates nothing more: nothing to free, the engine is the training model itself."""

    def _generate(self, prompt_ids, n, temperature, top_p, budgets: list[int], seeds):
        """One chunk: n completions of each prompt, each prompt's budget of new tokens ->
        (tokens (N, T'), log-probs (N, T'), T')."""
        device = next(self.model.parameters()).device
        max_new_tokens = max(budgets)
        input_ids, attention = left_pad(prompt_ids, self.pad_id)
        width = input_ids.shape[1]
        input_ids = input_ids.repeat_interleave(n, 0).to(device)
        attention = attention.repeat_interleave(n, 0).to(device)
        seeds = None if seeds is None else seeds.to(device)
        if self.decoder is not None:
            row_budgets = torch.tensor(budgets, device=device).repeat_interleave(n)     # (N,)
            completion, logprobs = self.decoder.generate(input_ids, attention, seeds, temperature, top_p,
                                                         max_new_tokens, row_budgets)
            return completion, logprobs, completion.shape[1]
        sampler = _GumbelSampler(seeds, width, temperature, top_p)
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                                  eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
                                  repetition_penalty=1.0, num_beams=1, return_dict_in_generate=True)
        cache = StaticCache(config=self.model.lm.config, max_cache_len=max(self.max_len, width + max_new_tokens)) \
            if self.loop == "generate-static" else None
        out = self.model(input_ids=input_ids, attention_mask=attention, generation_config=config,
                         logits_processor=LogitsProcessorList([sampler]), synced_gpus=self.synced,
                         generate=True, past_key_values=cache)
        completion = out.sequences[:, width:]                                   # (N, T')
        logprobs = torch.stack(sampler.logprobs, 1) if sampler.logprobs else completion.float()
        return completion, logprobs[:, :completion.shape[1]], completion.shape[1]


def _pad_right(x: Tensor, width: int, value) -> Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


def _lengths(parts, width: int) -> Tensor:
    """Columns actually generated in each part (a part may stop before `width`). (N, 1)"""
    return torch.cat([torch.full((p[0].shape[0], 1), p[2]) for p in parts]).to(parts[0][0].device)
