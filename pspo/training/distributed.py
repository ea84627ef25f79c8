"""torch.distributed plumbing: process group, FSDP2 sharding, reductions, full-state gather.

Launch with `torchrun --nproc_per_node=N train.py ...` (one or many nodes); a plain
`python train.py` is a world of one. gloo on CPU, NCCL on GPU. Each rank generates and scores
its own slice of prompts; a prompt's G completions stay on one rank, so group statistics need no
communication. Gradients (inside FSDP), logged sums and the step's (B, G) rewards cross ranks; the
rewards keep the per-prompt ERS/PPS state identical on every rank.
"""
from __future__ import annotations

import dataclasses

import os
import signal
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from tqdm import tqdm

from pspo.training.config import ConfigError
from pspo.training.model import decoder_layers


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Dist:
    """Join the torchrun process group if there is one; pick this rank's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    global _OWN_GROUP
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        _OWN_GROUP = True
    return Dist(rank, world_size, device)


_OWN_GROUP = False       # a world of one never creates a group; vLLM may create its own, which it cleans up


def shutdown(clean: bool) -> None:
    """Leave the process group. After a clean finish the ranks first wait for each other, so none
    tears its connections down while a peer still talks on them. After an error, no wait: the
    other ranks may never get there."""
    if _OWN_GROUP and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def finish(code: int, clean: bool) -> NoReturn:
    """End train.py: leave the process group, then exit with `code`.

    A rank that owned a process group ends with os._exit once its output is flushed: everything it
    writes (metrics, TensorBoard events, checkpoints) is closed by then, and skipping the
    interpreter's finalization avoids an abort seen in 2-process CPU runs under load: a rank that
    had finished and saved died with SIGABRT ("terminate called without an active exception") while
    the collective library's C++ threads were torn down at exit, turning a finished run into a
    failed one. A world of one exits normally.
    """
    owned = _OWN_GROUP
    shutdown(clean)
    if not owned:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shard(policy: torch.nn.Module, world_size: int, bf16: bool = False) -> torch.nn.Module:
    """FSDP2: `fully_shard` each decoder layer, then the root (the Policy wrapper).

    Decoder layers are found by the model's own `_no_split_modules` class names (model.decoder_layers),
    so any transformers architecture works. A world of one is left unsharded (nothing to shard; there
    model.bf16 is bf16 autocast, model.py). With bf16, FSDP2's mixed precision: the float32 master
    shards are all-gathered as bf16 for compute (no per-micro-batch casts of the weights) and the
    gradients are reduce-scattered in float32 into float32 shards, which AdamW updates.
    Layers compiled by build_policy (train.compile, model.compile_layers) are sharded here, after: the
    order torchtitan uses. Only their forward is compiled, so FSDP2's hooks (the all-gathers before a
    layer runs, the reduce-scatters after its backward) run eagerly around the compiled code.
    """
    if world_size == 1:
        return policy
    same_attention(policy.lm.config._attn_implementation)
    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    for layer in decoder_layers(policy.lm):
        fully_shard(layer, mp_policy=precision)
    fully_shard(policy, mp_policy=precision)
    return policy


def same_attention(name: str) -> None:
    """The ranks must score with one attention implementation (`name`: config._attn_implementation, which
    names the kernels pinned at start-up, e.g. "pspo_packed_varlen_flash"), but each rank's probe ran on its
    own GPU (packed_attention.choose_kernels): ConfigError on every rank, naming each rank's, when they differ."""
    names: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(names, name)
    if len(set(names)) > 1:
        ranks = "; ".join(f"rank {r}: {n}" for r, n in enumerate(names))
        raise ConfigError(f"train.attention: the ranks' probes chose different kernels ({ranks}); set "
                          "train.attention to a kernel every rank runs (math runs everywhere)")


def group_device() -> torch.device:
    """The device the process group's backend takes tensors on: cuda:LOCAL_RANK for NCCL (which
    rejects CPU tensors), cpu for gloo (which is what a CPU run uses)."""
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


# Every collective below runs on a copy of its input on group_device() and hands the result back on
# the input's device, so a caller may pass CPU tensors on a GPU run (the small sums and counts the
# advantages and SPO compute on CPU) or CUDA tensors on a CPU run. No module outside this one calls
# torch.distributed collectives (tests/checks/test_distributed_checks.py checks it).

def all_reduce_sum(x: Tensor) -> Tensor:
    """Sum over ranks, on x's device; identity (a copy) in a world of one."""
    return _all_reduce(x, dist.ReduceOp.SUM)


def all_reduce_max(x: Tensor) -> Tensor:
    """Elementwise max over ranks, on x's device; identity (a copy) in a world of one."""
    return _all_reduce(x, dist.ReduceOp.MAX)


def _all_reduce(x: Tensor, op) -> Tensor:
    if not dist.is_initialized():
        return x.clone()
    y = x.to(group_device(), copy=True)
    dist.all_reduce(y, op=op)
    return y.to(x.device)


def all_gather_rows(x: Tensor) -> Tensor:
    """Concatenate every rank's (n, ...) tensor along dim 0, in rank order: (world*n, ...) on x's device.

    Each rank must pass the same shape. Used for the (B, G) rewards, so the replicated ERS and
    PPS state sees the whole global batch on every rank.
    """
    if not dist.is_initialized():
        return x.clone()
    y = x.to(group_device())
    parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, y.contiguous())
    return torch.cat(parts).to(x.device)


def all_gather_ragged(x: Tensor) -> Tensor:
    """Every rank's 1-D x concatenated in rank order, on x's device; the lengths may differ (each is
    padded to the longest for the gather). Used for SPO-tree's new edges."""
    if not dist.is_initialized():
        return x
    lengths = all_gather_rows(torch.tensor([x.numel()], device=x.device)).tolist()   # (world,)
    padded = torch.zeros(1, max(1, max(lengths)), dtype=x.dtype, device=x.device)
    padded[0, :x.numel()] = x
    parts = all_gather_rows(padded)                                               # (world, longest)
    return torch.cat([parts[i, :n] for i, n in enumerate(lengths)])


def all_equal(value: bytes) -> bool:
    """True when every rank passed the same bytes (e.g. a digest of replicated state)."""
    if not dist.is_initialized():
        return True
    values: list[bytes] = [b""] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return all(v == values[0] for v in values)


def scatter_objects(objects: list | None) -> object:
    """Rank r's item of rank 0's `objects` (one picklable item per rank; None on the other ranks)."""
    if not dist.is_initialized():
        return objects[0]
    out = [None]
    dist.scatter_object_list(out, objects if dist.get_rank() == 0 else None, src=0)
    return out[0]


class PeerError(RuntimeError):
    """Rank 0 failed with a bug (it shows the traceback) while this rank waited for it at a collective: its one
    line, raised here too, so that this rank ends (exit 1) instead of waiting for a rank that will not come."""


def broadcast_object(value: object) -> object:
    """Rank 0's picklable `value` on every rank."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def reduce_sums(sums: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum a dict of per-rank scalars over ranks in one collective."""
    keys = sorted(sums)
    values = all_reduce_sum(torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=device))
    return dict(zip(keys, values.tolist()))


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(policy: torch.nn.Module, trainable_only: bool = False) -> dict[str, Tensor]:
    """The unsharded transformers state dict (keys without the `lm.` prefix), on CPU; trainable_only:
    the parameters that train (LoRA's adapters), not the frozen base.

    Every rank must call it (it gathers); only rank 0's copy is complete and meant to be used.
    """
    options = dataclasses.replace(_FULL, ignore_frozen_params=True) if trainable_only else _FULL
    state = get_model_state_dict(policy, options=options)
    return {k.removeprefix("lm."): v for k, v in state.items()}


def full_optimizer_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return get_optimizer_state_dict(policy, optimizer, options=_FULL)


def load_full_optimizer_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    set_optimizer_state_dict(policy, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))


def print0(*args, file=None) -> None:
    """print on rank 0 only, keeping `if rank == 0` out of the loop (tqdm.write: under the bar).
    Errors go to file=sys.stderr."""
    if int(os.environ.get("RANK", "0")) == 0:
        tqdm.write(" ".join(str(a) for a in args), file=file)


class PreemptionSignal:
    """SIGTERM / SIGUSR1, what cluster schedulers send before killing a job, as a flag.

    The handler only records the signal; the loop asks `requested()` once per step, after the
    step is complete, saves and exits 0. The flag is max-reduced over ranks, so every rank stops
    after the same step even if only one received the signal. (torchrun forwards SIGTERM to its
    workers and kills them 30 s later.)
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)):
        self.name: str | None = None
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.name = signal.Signals(signum).name

    def requested(self, device: torch.device) -> bool:
        """Collective: True on every rank when any rank received a signal."""
        return bool(all_reduce_max(torch.tensor(float(self.name is not None), device=device)) > 0)
