"""The log-prob head's variants side by side: the checkpointed log_softmax it replaced, and
pspo/training/token_logprobs.py eager and compiled (model.logprob_head).

    python bench/logprob_head.py        # 4096 tokens x hidden 1536 x vocab 32768: ~15 min on 2 CPU cores
    python bench/logprob_head.py --tokens 1024 --vocab 8192 --reps 3          # quicker
    python bench/logprob_head.py --tokens 8192 --vocab 151936 --reps 5        # a GPU: the 1.5B's vocabulary

`checkpointed` is the head as it was: each chunk of tokens runs log_softmax(h·Wᵀ/T) in float32
(autocast off) under torch.utils.checkpoint, and autograd's gather backward scatters a dense
(chunk x vocab) gradient. `eager` is token_logprobs (head="eager"): an autograd.Function that keeps one
log-sum-exp per token and forms grad_z = g·(onehot - softmax)/T per chunk in backward, in place, one
pass per operation. `compiled` (head="compiled") runs each chunk's statistics and grad_z as one
torch.compile'd function (its compile falls in the warm-up round). All run
forward + backward of sum(logp · upstream) on the same random inputs (float32 master weight and
hidden states), in two modes: fp32 (no autocast) and bf16 (bf16 autocast, as model.bf16 runs it;
the old head ignores it, the new one multiplies bf16 operands into float32 logits; on CPU that is
a float32 matmul of the bf16-rounded operands, so no bf16 speed-up is expected there, only on a GPU).
It runs on the GPU when there is one (--device), timed with synchronisation.

Columns: median forward+backward seconds over --reps (after one warm-up), the bytes kept for
backward beyond the inputs (saved_tensors_hooks, unique storages), the peak of the bytes allocated
during forward+backward (on CPU the storages created and not yet freed, weight.grad included, not
counted for the compiled head; on a GPU the allocator's peak), and the
differences from the checkpointed float32 head: the largest |Δlogp|, and the largest |Δ| of each
gradient over that gradient's largest entry.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import weakref

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pspo.training.token_logprobs import token_logprobs  # noqa: E402


def _chunk_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor,
                    temperature: float) -> tuple[Tensor, Tensor]:
    """The previous head: (n, H), (V, H), (n,) -> logp (n,), entropy (n,) detached, in float32."""
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        logp_all = torch.log_softmax(hidden.float() @ weight.float().T / temperature, dim=-1)  # (n, V)
        logp = logp_all.gather(1, targets[:, None]).squeeze(1)                                 # (n,)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)                                         # (n,)
    return logp, entropy


def checkpointed_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                          chunk_tokens: int) -> tuple[Tensor, Tensor]:
    """The previous token_logprobs: chunks of tokens, each checkpointed. (N, T, H) -> (N, T), (N, T)."""
    N, T, H = hidden.shape
    flat_hidden, flat_targets = hidden.reshape(N * T, H), targets.reshape(N * T)
    logps, entropies = [], []
    for start in range(0, N * T, chunk_tokens):
        h = flat_hidden[start:start + chunk_tokens]
        t = flat_targets[start:start + chunk_tokens]
        logp, entropy = checkpoint(_chunk_logprobs, h, weight, t, temperature, use_reentrant=False)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps).view(N, T), torch.cat(entropies).view(N, T)


HEADS = {"checkpointed": checkpointed_logprobs,
         "eager": lambda *a: token_logprobs(*a, head="eager"),
         "compiled": lambda *a: token_logprobs(*a, head="compiled")}


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created inside the mode, each counted until it is freed."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.live or key in inputs or storage.nbytes() == 0:   # a view or an in-place result
                continue
            self.live[key] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._free, key)
        return out


def make_inputs(tokens: int, hidden: int, vocab: int, seed: int = 0,
                device: str = "cpu") -> tuple[Tensor, ...]:
    """hidden (1, tokens, H) and weight (V, H) float32 leaves, targets (1, tokens), upstream (1, tokens)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(1, tokens, hidden, generator=g).to(device).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(device).requires_grad_()   # logits O(1)
    targets = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    return h, w, targets, torch.randn(1, tokens, generator=g).to(device)


def run_once(head: str, mode: str, inputs: tuple[Tensor, ...], chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """forward + backward of sum(logp · upstream); returns logp, hidden.grad, weight.grad."""
    h, w, targets, upstream = inputs
    h.grad, w.grad = None, None
    with torch.autocast(device_type=h.device.type, dtype=torch.bfloat16, enabled=(mode == "bf16")):
        logp, _ = HEADS[head](h, w, targets, 0.7, chunk)
    (logp * upstream).sum().backward()
    if h.device.type == "cuda":
        torch.cuda.synchronize()
    return logp.detach(), h.grad, w.grad


def saved_bytes(head: str, mode: str, inputs: tuple[Tensor, ...], chunk: int) -> int:
    """Bytes kept for backward beyond the inputs: unique storages seen by saved_tensors_hooks."""
    h, w, targets, _ = inputs
    own = {t.untyped_storage().data_ptr() for t in (h, w, targets)}
    storages = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            storages[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(device_type=h.device.type, dtype=torch.bfloat16, enabled=(mode == "bf16")):
            logp, _ = HEADS[head](h, w, targets, 0.7, chunk)
    del logp
    return sum(storages.values())


def peak_bytes(head: str, mode: str, inputs: tuple[Tensor, ...], chunk: int) -> int | None:
    """The peak of the bytes allocated during forward+backward: CUDA's allocator statistics on a GPU;
    on CPU the storages LiveBytes sees, which excludes the compiled head (None: inductor's compiled code
    allocates its buffers outside the dispatcher, which that count relies on)."""
    h = inputs[0]
    if h.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run_once(head, mode, inputs, chunk)
        return torch.cuda.max_memory_allocated() - before
    if head == "compiled":
        return None
    with LiveBytes() as live:
        run_once(head, mode, inputs, chunk)
    return live.peak


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=2048, help="chunk_tokens (model.logprob_chunk_tokens)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--heads", default=",".join(HEADS), help="which heads, comma-separated")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    heads = args.heads.split(",")
    inputs = make_inputs(args.tokens, args.hidden, args.vocab, device=args.device)
    where = (torch.cuda.get_device_name() if args.device == "cuda"
             else f"CPU, {torch.get_num_threads()} threads")
    print(f"{args.tokens} tokens x hidden {args.hidden} x vocab {args.vocab}, chunks of {args.chunk}, "
          f"{where}, torch {torch.__version__}")
    reference = run_once("checkpointed", "fp32", inputs, args.chunk)
    MiB = 2**20
    header = (f"{'mode':5} {'head':13} {'fwd+bwd s':>9} {'saved KiB':>9} {'peak MiB':>9} "
              f"{'max|dlogp|':>10} {'rel dgrad_h':>11} {'rel dgrad_W':>11}")
    print(header)
    print("-" * len(header))
    for mode in ("fp32", "bf16"):
        times = {head: [] for head in heads}
        for rep in range(args.reps + 1):                   # interleaved, so drifts in load hit all alike
            for head in heads:
                start = time.perf_counter()
                out = run_once(head, mode, inputs, args.chunk)
                if rep > 0:                                # the first round is a warm-up
                    times[head].append(time.perf_counter() - start)
        for head in heads:
            out = run_once(head, mode, inputs, args.chunk)
            diffs = [(a.float() - b).abs().max().item() for a, b in zip(out, reference)]
            scales = [1.0] + [b.abs().max().item() for b in reference[1:]]      # logp: absolute
            print(f"{mode:5} {head:13} {statistics.median(times[head]):9.2f} "
                  f"{saved_bytes(head, mode, inputs, args.chunk) / 2**10:9.1f} "
                  f"{_mib(peak_bytes(head, mode, inputs, args.chunk)):>9} "
                  f"{diffs[0]:10.2e} {diffs[1] / scales[1]:11.2e} {diffs[2] / scales[2]:11.2e}")


if __name__ == "__main__":
    main()
