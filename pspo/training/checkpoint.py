"""Checkpoints: a Hugging Face model folder plus what an exact resume needs.

<output_dir>/checkpoint-<step>/
    config.json, generation_config.json, model.safetensors, tokenizer files   (from_pretrained)
      or, with LoRA (model.lora.rank > 0): adapter_config.json, adapter_model.safetensors (peft's
      format, PeftModel.from_pretrained on the base), tokenizer files
    optimizer.pt      full AdamW state (tensors, numbers, lists only; with LoRA, the adapters')
    trainer_state.pt  step, scheduler, sampler (uniform order or PPS priorities + RNG), ERS statistics,
                      generated_tokens so far, SPO-tree's replay buffer, the method and sampler mode
    rng-rank<r>.pt    rank r's torch RNG states, and a digest of the trainer state as rank r held it

The trainer state is replicated: every rank holds the same sampler, ERS and replay state. Saving checks
that (the digests of all ranks must agree) and stops with an error if a bug ever breaks it.

Written under `.tmp-checkpoint-<step>` and renamed when complete, so a crash mid-save never
leaves a broken newest checkpoint. Loading uses safetensors and `torch.load(weights_only=True)`:
nothing is unpickled beyond tensors and plain containers. Assumes output_dir is on a file system
all ranks see (the usual shared disk of a multi-node job).
"""
from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil

import torch
from safetensors.torch import save_file
from torch import Tensor

from pspo.training import distributed
from pspo.training.config import Config, ConfigError, error_line
from pspo.training.distributed import Dist
from pspo.training.lora import check_adapter_config, is_adapter, save_adapter

_NAME = re.compile(r"checkpoint-(\d+)$")


def checkpoint_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"checkpoint-{step}")


def save_checkpoint(output_dir: str, step: int, *, policy: torch.nn.Module, tokenizer,
                    optimizer: torch.optim.Optimizer, trainer_state: dict, dist_: Dist,
                    keep: int = 0) -> str:
    """Collective: every rank calls it. Returns the final checkpoint path."""
    final = checkpoint_path(output_dir, step)
    tmp = os.path.join(output_dir, f".tmp-checkpoint-{step}")
    peft_model = getattr(policy, "peft", None)                  # LoRA: the adapter alone (lora.py)
    model_state = distributed.full_model_state(policy, trainable_only=peft_model is not None)   # gathers
    optim_state = distributed.full_optimizer_state(policy, optimizer)
    if dist_.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        lm = policy.lm
        if peft_model is not None:
            save_adapter(peft_model, model_state, tmp)           # peft's adapter_config.json + safetensors
        else:
            if lm.config.tie_word_embeddings:                    # one tensor, stored once
                model_state.pop("lm_head.weight", None)
            save_file({k: v.contiguous() for k, v in model_state.items()}, os.path.join(tmp, "model.safetensors"),
                      metadata={"format": "pt"})
            lm.config.save_pretrained(tmp)
            lm.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save(optim_state, os.path.join(tmp, "optimizer.pt"))
    del model_state, optim_state
    distributed.barrier()
    digest = state_digest(trainer_state)
    rng = {"cpu": torch.get_rng_state(), "trainer_state_sha256": digest.hex()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, os.path.join(tmp, f"rng-rank{dist_.rank}.pt"))
    replicated = distributed.all_equal(digest)
    distributed.barrier()
    if dist_.is_main:
        torch.save(trainer_state, os.path.join(tmp, "trainer_state.pt"))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)                                   # atomic on one file system
        _prune(output_dir, keep)
    distributed.barrier()
    if not replicated:                                           # saved (rank 0's view) first, then stop
        raise RuntimeError(f"{final}: the sampler/ERS state differs across ranks (see trainer_state_sha256 "
                           "in rng-rank*.pt); it must be replicated, this is a bug")
    return final


def state_digest(state) -> bytes:
    """SHA-256 over a nest of dicts/lists of tensors and plain values (dict keys in sorted order)."""
    h = hashlib.sha256()

    def visit(x) -> None:
        if isinstance(x, dict):
            for key in sorted(x, key=str):
                h.update(f"<{key}>".encode())
                visit(x[key])
        elif isinstance(x, (list, tuple)):
            for item in x:
                visit(item)
        elif isinstance(x, Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(x).encode())
    visit(state)
    return h.digest()


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints, oldest first (temporary folders are never listed)."""
    found = []
    for path in glob.glob(os.path.join(output_dir, "checkpoint-*")):
        m = _NAME.search(path)
        if m and os.path.exists(os.path.join(path, "trainer_state.pt")):
            found.append((int(m.group(1)), path))
    return sorted(found)


def resolve_resume(cfg: Config, sampler_mode: str) -> str | None:
    """train.resume: "" -> None; "auto" -> the newest checkpoint in train.output_dir (or None); else a
    path. The checkpoint is checked here, before a model is built or loaded: its trainer state reads
    back and was trained under this run's method, sampler mode and ERS (`check_modes`), and it holds a
    LoRA adapter of model.lora's settings exactly when model.lora.rank > 0 (full weights otherwise)."""
    resume, lora = cfg.train.resume, cfg.model.lora
    if resume == "":
        return None
    if resume == "auto":
        found = list_checkpoints(cfg.train.output_dir)
        if not found:
            return None
        path = found[-1][1]
    elif not os.path.isfile(os.path.join(resume, "trainer_state.pt")):
        raise CheckpointError(f"train.resume: {resume!r} is not a checkpoint folder (no trainer_state.pt)")
    else:
        path = resume
    check_modes(read_trainer_state(path), cfg, sampler_mode)
    if (lora.rank > 0) != is_adapter(path):
        raise CheckpointError(f"train.resume: {path} holds {'full weights' if lora.rank else 'a LoRA adapter'}; "
                              f"model.lora.rank {lora.rank} {'needs' if lora.rank else 'trains without'} "
                              "adapters: resume with the settings it was trained with")
    if lora.rank > 0:
        check_adapter_config(path, lora)
    return path


class CheckpointError(ValueError):
    """A checkpoint that cannot be read back; one line naming the file (train.py: exit code 2)."""


def _load(path: str, name: str, **kwargs):
    """torch.load(weights_only=True) of one checkpoint file, any failure as one CheckpointError line."""
    file = os.path.join(path, name)
    try:
        return torch.load(file, weights_only=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - truncated, corrupt or foreign files raise many types
        raise CheckpointError(f"train.resume: cannot read {file} ({error_line(e, 200)}); "
                              "resume from another checkpoint") from None


def read_trainer_state(path: str) -> dict:
    """The checkpoint's trainer state, refused (CheckpointError) when it is not one pspo wrote."""
    state = _load(path, "trainer_state.pt")
    if not isinstance(state, dict) or not {"step", "scheduler", "sampler"} <= set(state):
        raise CheckpointError(f"train.resume: {os.path.join(path, 'trainer_state.pt')} "
                              "is not a pspo trainer state")
    return state


def load_trainer_state(path: str, rank: int) -> dict:
    """The trainer state, with this rank's RNG states restored."""
    state = read_trainer_state(path)
    rng_file = f"rng-rank{rank}.pt"
    if os.path.exists(os.path.join(path, rng_file)):             # absent when resuming on more ranks
        rng = _load(path, rng_file)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return state


def trainer_state(step: int, *, scheduler, sampler, method_state, generated_tokens: float, cfg: Config,
                  sampler_mode: str) -> dict:
    """What an exact resume needs beside the weights and AdamW: the step, the schedule, the replicated
    sampler and method state (methods.MethodState: ERS's statistics, SPO-tree's buffer), the tokens
    generated so far, and the method and sampler mode the run trained with (a resume under another
    one is refused)."""
    return {"step": step, "scheduler": scheduler.state_dict(), "sampler": sampler.state_dict(),
            **method_state.state_dict(), "generated_tokens": generated_tokens,
            "advantage": cfg.algo.advantage, "sampler_mode": sampler_mode}


def restore_trainer_state(state: dict, sampler, method_state, cfg: Config, sampler_mode: str) -> None:
    """Load the replicated state of a checkpoint into the run's sampler and method state (`check_modes`
    first)."""
    check_modes(state, cfg, sampler_mode)
    try:
        sampler.load_state_dict(state["sampler"])
        method_state.load_state_dict(state)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_modes(state: dict, cfg: Config, sampler_mode: str) -> None:
    """A checkpoint trained under another algo.advantage or sampler mode (uniform, PPS paper or
    reference), or with ERS switched the other way, is refused with one ConfigError line naming both
    values. Hyperparameters (ers.alpha, pps.alpha, beta, ...) come from the config and may change on
    resume like any other field; an exact continuation needs the same config.
    """
    was_mode = state.get("sampler_mode")
    if was_mode is None:                  # older checkpoints: the sampler's own keys tell PPS from uniform
        was_mode = ("reference" if "reference_priorities" in state["sampler"] else
                    "paper" if "priorities" in state["sampler"] else "uniform")
    both_pps = "uniform" not in (sampler_mode, was_mode)
    pps_key = "pps.mode" if both_pps else "pps.enabled"
    as_pps = (lambda mode: mode) if both_pps else (lambda mode: str(mode != "uniform").lower())
    for key, now, was in (("algo.advantage", cfg.algo.advantage, state.get("advantage", cfg.algo.advantage)),
                          (pps_key, as_pps(sampler_mode), as_pps(was_mode)),
                          ("ers.enabled", str(cfg.ers.enabled).lower(),
                           str(state.get("ers") is not None).lower())):
        if now != was:
            raise ConfigError(f"{key}: the checkpoint was trained with {key}={was}, this run has "
                              f"{key}={now}; resume with the same setting")


def load_optimizer(path: str, policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    state = _load(path, "optimizer.pt", map_location="cpu")
    try:
        distributed.load_full_optimizer_state(policy, optimizer, state)
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"train.resume: {os.path.join(path, 'optimizer.pt')} does not match the model "
                              f"({type(e).__name__}: {str(e)[:200]})") from None


def _prune(output_dir: str, keep: int) -> None:
    if keep <= 0:
        return
    for _, path in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
