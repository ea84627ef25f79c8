"""PSPO*'s process reward model in training, docs/related.md §C: a frozen sequence classifier that
scores every step of a completion, and R from those scores (the math in pspo/related/process_reward.py).

`load_prm(cfg, device)` loads `prm.model` (any AutoModelForSequenceClassification folder or hub id,
or builtin:tiny-prm) when reward.prm != 0, and checks it at start-up: a model or tokenizer that does
not load, a classifier whose head is not in the checkpoint (a causal LM loaded as a classifier gets a
random head), fewer labels than prm.label + 1, inputs longer than its positions (prm.max_tokens), or
a tokenizer with no sep token to pair steps with (prm.separator "") stop the run with one line
naming the key (ConfigError: exit 2).

The PRM is frozen: requires_grad False, eval mode, its own copy on each rank's device (bf16 on a GPU,
float32 on the CPU), never wrapped by FSDP, never in the optimizer nor in a checkpoint.

Scoring a batch of completions (`PRM.__call__`, called by rewards.score_completions where the
rewards are summed): split every completion into steps (prm.split), pair each step with the one
before it (§C, "Step scores"), tokenize all the pairs at once (truncated to prm.max_tokens), sort
them by length and run padded forwards of at most prm.batch_tokens tokens each (rows x longest row);
a step's score is softmax(logits)[prm.label] in float32. So a training step's thousands of steps
cost a few forwards; padding changes no score (tests/components/test_prm.py compares them with
one-at-a-time
scoring).
The pair is the tokenizer's own pair encoding ("[CLS] a [SEP] b [SEP]" for BERT, token types
included) when prm.separator is "", else one text, previous step + separator + step (the released
code joins them with " </s><s>").

`PRM.take()` hands over what it did since the last call (completions, steps, summed g, seconds);
`prm_metrics` turns it into the logged means over ranks.
"""
from __future__ import annotations

import os
import time

import torch
from torch import Tensor
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from transformers.utils import logging as hf_logging

from pspo.training import distributed
from pspo.offline.builtin import resolve_model_path
from pspo.training.config import Config, ConfigError, PRMConfig
from pspo.training.config import first_line
from pspo.related.process_reward import geometric_mean, shaped_reward, split_steps, step_pairs


class PRM:
    """A frozen step classifier and the prm section: completions -> R, one per completion."""

    def __init__(self, model: torch.nn.Module, tokenizer, cfg: PRMConfig):
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.pad_id = tokenizer.pad_token_id
        self.counts = self._zero()

    @staticmethod
    def _zero() -> dict[str, float]:
        return {"prm_completions": 0.0, "prm_steps": 0.0, "prm_scored": 0.0, "prm_score": 0.0, "prm_s": 0.0}

    def __call__(self, completions: list[str]) -> list[float]:
        """R of each completion, §C: 0 with fewer than two steps, else shaped from its step scores."""
        start = time.perf_counter()
        steps = [split_steps(text, self.cfg.split) for text in completions]           # (N,) lists
        pairs = [pair for s in steps if len(s) > 1 for pair in step_pairs(s)]        # one completion is 0
        flat = self.step_scores(pairs)                                                # (Σ n,) s_j
        rewards, means, at = [], [], 0
        for s in steps:
            if len(s) <= 1:
                rewards.append(0.0)
                continue
            scores, at = flat[at:at + len(s)], at + len(s)
            means.append(geometric_mean(scores))
            rewards.append(shaped_reward(scores, self.cfg.shaping))
        c = self.counts
        c["prm_completions"] += len(completions)
        c["prm_steps"] += sum(len(s) for s in steps)
        c["prm_scored"] += len(means)
        c["prm_score"] += sum(means)
        c["prm_s"] += time.perf_counter() - start
        return rewards

    def encode(self, pairs: list[tuple[str | None, str]]) -> list[dict[str, list[int]]]:
        """Token ids of each (previous step or None, step), truncated to prm.max_tokens (§C)."""
        kw = {"truncation": True, "max_length": self.cfg.max_tokens}
        sep = self.cfg.separator
        if sep:                                                                       # one text
            texts = [step if prev is None else prev + sep + step for prev, step in pairs]
            batch = self.tokenizer(texts, **kw)
            return [{k: batch[k][i] for k in batch} for i in range(len(pairs))]
        out: list[dict[str, list[int]]] = [{} for _ in pairs]
        alone = [i for i, (prev, _) in enumerate(pairs) if prev is None]          # first steps
        paired = [i for i, (prev, _) in enumerate(pairs) if prev is not None]
        if alone:
            batch = self.tokenizer([pairs[i][1] for i in alone], **kw)
            for j, i in enumerate(alone):
                out[i] = {k: batch[k][j] for k in batch}
        if paired:                                                                    # the tokenizer's pairs
            batch = self.tokenizer([pairs[i][0] for i in paired], [pairs[i][1] for i in paired], **kw)
            for j, i in enumerate(paired):
                out[i] = {k: batch[k][j] for k in batch}
        return out

    @torch.inference_mode()
    def step_scores(self, pairs: list[tuple[str | None, str]]) -> list[float]:
        """P(prm.label) of each pair, in padded forwards of at most prm.batch_tokens tokens, longest first."""
        if not pairs:
            return []
        encoded = self.encode(pairs)
        order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]["input_ids"]))
        scores = [0.0] * len(encoded)
        device = next(self.model.parameters()).device
        start = 0
        while start < len(order):
            longest = len(encoded[order[start]]["input_ids"])                # sorted: the first is longest
            rows = order[start:start + max(1, self.cfg.batch_tokens // longest)]
            inputs = self._pad([encoded[i] for i in rows], longest, device)          # (b, longest) each
            logits = self.model(**inputs).logits.float()                              # (b, labels)
            probs = logits.softmax(dim=-1)[:, self.cfg.label].tolist()               # (b,) s_j
            for i, p in zip(rows, probs):
                scores[i] = p
            start += len(rows)
        return scores

    def _pad(self, rows: list[dict[str, list[int]]], width: int, device: torch.device) -> dict[str, Tensor]:
        """Right-padded (b, width) tensors: input_ids with the pad id, the attention mask and any
        token types with 0 (absolute positions of the real tokens unchanged)."""
        out = {}
        for key in rows[0]:
            fill = self.pad_id if key == "input_ids" else 0
            out[key] = torch.tensor([r[key] + [fill] * (width - len(r[key])) for r in rows], device=device)
        return out

    def take(self) -> dict[str, float]:
        """This rank's counts since the last take (then zeroed)."""
        counts, self.counts = self.counts, self._zero()
        return counts


def check_prm_path(cfg: Config) -> None:
    """ConfigError (one line) when reward.prm is on and prm.model is a local path with no folder. Needs
    no model: train.py runs it before one is built or loaded (and load_prm again)."""
    p = cfg.prm
    if cfg.reward.prm != 0 and os.path.isabs(p.model) and not os.path.isdir(p.model):
        raise ConfigError(f"prm.model: {p.model!r}: no such folder (expected a sequence classifier's folder "
                          "or hub id)")


def load_prm(cfg: Config, device: torch.device) -> PRM | None:
    """The PRM of the prm section on `device`, frozen, or None when reward.prm is 0. ConfigError (one
    line naming the key) when it cannot serve as the PRM (module docstring)."""
    p = cfg.prm
    if cfg.reward.prm == 0:
        return None
    check_prm_path(cfg)
    path = resolve_model_path(p.model)                     # builtin:tiny-prm is built here once
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()          # its load report would print before our one-line error
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=p.trust_remote_code)
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=dtype, trust_remote_code=p.trust_remote_code, output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - missing, not a classifier, remote code refused, corrupt
        raise ConfigError(f"prm.model: cannot load {p.model!r} as a tokenizer and an "
                          f"AutoModelForSequenceClassification ({first_line(e)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if info["missing_keys"]:
        missing = ", ".join(sorted(info["missing_keys"])[:3])
        raise ConfigError(f"prm.model: {p.model!r} has no trained classification head ({missing} not in the "
                          "checkpoint, randomly initialised): expected a fine-tuned sequence classifier")
    labels = model.config.num_labels
    if p.label >= labels:
        raise ConfigError(f"prm.label: expected an index below the PRM's {labels} labels "
                          f"({model.config.id2label}), got {p.label}")
    positions = getattr(model.config, "max_position_embeddings", None)
    if isinstance(positions, int) and p.max_tokens > positions:
        raise ConfigError(f"prm.max_tokens: expected at most the PRM's {positions} positions, "
                          f"got {p.max_tokens}")
    if not p.separator and tokenizer.sep_token is None:
        raise ConfigError(f"prm.separator: {p.model!r}'s tokenizer has no sep token to pair steps with; "
                          "expected a text to join them (e.g. \" </s><s>\")")
    if tokenizer.pad_token_id is None:                   # a decoder PRM: pad with eos, as load_tokenizer does
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.pad_token_id is None:
        raise ConfigError(f"prm.model: {p.model!r}'s tokenizer has neither a pad nor an eos token; "
                          "expected one to pad a batch of steps with")
    if model.config.pad_token_id is None:                # decoder classifiers find the last token by it
        model.config.pad_token_id = tokenizer.pad_token_id
    model.requires_grad_(False)
    model.eval()
    return PRM(model.to(device), tokenizer, p)


def prm_metrics(prm: PRM | None, device: torch.device, step_s: float) -> dict[str, float]:
    """The step's PRM metrics over every completion it scored (SPO's continuations included), all
    ranks: prm_steps (mean n), prm_scored_frac (share with n >= 2), prm_score (mean g of those; NaN
    if none), prm_s (this rank's seconds in the PRM, part of reward_s / advantages_s) and prm_share
    (prm_s over the step's seconds so far, step_s, which is the step time before logging). Collective."""
    if prm is None:
        return {}
    counts = prm.take()
    seconds = counts.pop("prm_s")
    sums = distributed.reduce_sums(counts, device)
    completions, scored = max(sums["prm_completions"], 1.0), sums["prm_scored"]
    return {"prm_steps": sums["prm_steps"] / completions, "prm_scored_frac": scored / completions,
            "prm_score": sums["prm_score"] / scored if scored else float("nan"), "prm_s": seconds,
            "prm_share": seconds / max(step_s, 1e-9)}
