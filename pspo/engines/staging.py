"""The weight transport of asynchronous rollouts (docs/gpu.md, "One step off"): one buffer of shared host
memory that rank 0 writes the policy's weights into and the engine processes read them from.

Why host memory and not an NCCL broadcast: a copy into mapped memory cannot hang on a dead peer (every
wait across processes is a pipe with a deadline, engines/process.py), it serves the one-GPU layout where
trainer and engine share a device, it is the same code on CPU and GPU, and it needs no process group
beyond the trainer's. It costs one copy of the weights in host RAM (in the engine's dtype) and one copy
per version; with LoRA only the adapter moves.

The buffer is a file in /dev/shm reserved with `posix_fallocate` (a tmpfs too small for it refuses it
there, with ENOSPC; `ftruncate` + `mmap`, what `multiprocessing.shared_memory` does, would reserve
nothing and the first write past the free space would kill the process with SIGBUS) and unlinked at
once: no name is left to leak after a kill -9, and the memory goes with the last process holding its fd.

`row_sums` lives here too: the exact checksums with which the sync check compares what an engine computes
with against what the trainer staged or streamed (engines/vllm_engine.py uses them in process as well).
"""
from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from pspo.training.config import ConfigError

ALIGN = 64                     # bytes: every tensor starts on a cache line
SHM = "/dev/shm"


@dataclass(frozen=True)
class Entry:
    """Where one tensor lives in the buffer."""
    name: str                  # the trainer's parameter name (full_params / adapter_params order)
    dtype: torch.dtype         # the engine's dtype
    shape: tuple[int, ...]
    offset: int                # bytes from the buffer's start, a multiple of ALIGN
    nbytes: int


Layout = list[Entry]


def layout(shapes: Iterable[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> Layout:
    """The buffer's entries for (name, global shape) in order, each `dtype`, ALIGN-aligned."""
    entries, offset = [], 0
    itemsize = torch.empty(0, dtype=dtype).element_size()
    for name, shape in shapes:
        nbytes = itemsize * int(torch.Size(shape).numel())
        entries.append(Entry(name, dtype, tuple(shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries


def policy_shapes(lm: torch.nn.Module, *, lora: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(name, global shape) of what the engines load, in the order vllm_engine.full_params (or, with LoRA,
    adapter_params) yields it: no gather is needed (a DTensor's shape is global). A tied head is staged once,
    as the embedding it is (the engines tie theirs to it)."""
    return [(n, tuple(p.shape)) for n, p in lm.named_parameters() if not lora or "lora_" in n]


def total_bytes(entries: Layout) -> int:
    return entries[-1].offset + -(-entries[-1].nbytes // ALIGN) * ALIGN if entries else 0


INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.no_grad()
def row_sums(t: Tensor) -> Tensor:
    """Per row of `t` (its first dim; a 1-D tensor's rows are its elements) the sum of the elements' bits
    read as integers: (rows,) int64, on the CPU. Integer sums are exact, so equal tensors give equal sums
    on any device and in any order of summation, and a tensor made by concatenating others along dim 0
    (vLLM's qkv_proj, gate_up_proj) has their sums concatenated. One element that changes changes its
    row's sum (by the difference of its bits); two in a row cancel only if those differences do."""
    bits = t.detach().contiguous().view(INT_OF_SIZE[t.element_size()])
    bits = bits.reshape(bits.shape[0] if bits.dim() else 1, -1)                   # (rows, row length)
    chunk = max(1, 2**24 // max(1, bits.shape[1]))                              # ≤ 128 MB of int64 at a time
    sums = [bits[i:i + chunk].long().sum(dim=1) for i in range(0, bits.shape[0], chunk)]
    return torch.cat(sums).cpu() if sums else torch.zeros(0, dtype=torch.long)


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def room_error(need: int, free: int, path: str) -> ConfigError:
    return ConfigError(f"rollout.mode: async stages the weights in {path}: {gib(need)} needed, {gib(free)} free; "
                       "enlarge it (docker run --shm-size=...) or train a LoRA adapter (model.lora.rank > 0), "
                       "which stages the adapter only")


def check_room(need: int, path: str = SHM) -> None:
    """ConfigError (one line) when `path` has less free space than `need` bytes; nothing is allocated."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise room_error(need, free, path)


class StagingBuffer:
    """The buffer (rank 0): `fd` is passed to the engines, `flat` is its bytes as a (nbytes,) uint8 tensor."""

    def __init__(self, nbytes: int, path: str = SHM):
        name = os.path.join(path, f"pspo-{os.getpid()}-weights")
        self.fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.unlink(name)                                     # nameless from now on
            try:
                os.posix_fallocate(self.fd, 0, max(nbytes, 1))  # the pages are reserved now: no SIGBUS later
            except OSError as e:
                st = os.statvfs(path)
                raise room_error(nbytes, st.f_bavail * st.f_frsize, path) from e
            self.map = mmap.mmap(self.fd, max(nbytes, 1))
        except BaseException:
            os.close(self.fd)
            raise
        self.nbytes = nbytes
        self.flat = torch.frombuffer(self.map, dtype=torch.uint8)

    def close(self) -> None:
        del self.flat
        self.map.close()
        os.close(self.fd)


def view(flat: Tensor, e: Entry) -> Tensor:
    """Entry `e` of a buffer's bytes, as its tensor (shares the memory)."""
    return flat[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)


@torch.no_grad()
def stage(flat: Tensor | None, params: Iterator[tuple[str, Tensor]], entries: Layout,
          sums: bool = False) -> tuple[float, dict[str, Tensor]]:
    """Copy `params` ((name, full tensor) in the layout's order; collective under FSDP2, so every rank
    iterates) into the buffer `flat` (rank 0; None on the other ranks), rounded to the engine's dtype.
    Returns (seconds, {name: row_sums} of the trainer's tensors so rounded when `sums`, for the sync check:
    the engine's sums must equal them, whatever reached the buffer)."""
    start, kept = time.perf_counter(), {}
    for e, (name, tensor) in zip(entries, params, strict=True):
        if name != e.name or tuple(tensor.shape) != e.shape:
            raise ValueError(f"staging: expected {e.name} {e.shape}, got {name} {tuple(tensor.shape)}")
        if flat is not None:
            view(flat, e).copy_(tensor)
            if sums:                                            # of the trainer's tensor, not the buffer's
                kept[name] = row_sums(tensor.to(e.dtype))
    return time.perf_counter() - start, kept


def views(flat: Tensor, entries: Layout) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) of every entry, reading the buffer in place (the engine's side)."""
    for e in entries:
        yield e.name, view(flat, e)
