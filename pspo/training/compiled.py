"""torch.compile in pspo: one rule for every compiled path, and the compile metrics (docs/gpu.md#compiled-paths).

Three paths compile, each by its own setting: the decoding step and sampler (rollout.compile, engines/decode.py),
the decoder layers for scoring (train.compile, model.compile_layers) and the log-prob head's chunk functions
(model.logprob_head, token_logprobs.py). Each is a `Compiled`.

The rule: a compile that fails never stops a run. When compiling a path fails (an error of dynamo, inductor,
Triton or the host C compiler; or dynamo's recompile limit passed, which would otherwise run the code eagerly
in silence), that path runs its function eagerly from then on in this process: the same values up to float
rounding, more kernel launches. One line on stderr names the path, the compiler's error and the setting that
turns the compile off, and the step's `compile_fallbacks` counts it. The eager run repeats a call that did not
finish; each path's function is safe to repeat (it writes nothing, or writes what the repeat writes again).

`compile_recompiles` counts dynamo's compiles of code it had compiled before (another kind of pass, or a shape
or guard the earlier graphs do not cover) in the step. The first steps meet each kind of pass once; a count
that keeps growing is a recompile to find (TORCH_LOGS=recompiles prints each one's reason). Both metrics are
this process's: an engine process (rollout.mode=async) prints its own line, which the trainer's counts miss.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch._dynamo
import torch._functorch.config
from torch._dynamo.callback import CallbackArgs, CallbackTrigger
from torch._dynamo.exc import FailOnRecompileLimitHit
from torch._guards import CompileContext

# dynamo's limit of compiles per code object, raised from its default 8: the layers compile once per kind of
# pass (about 10 with LoRA and its base as the KL reference), the decoding step once per cache length
RECOMPILE_LIMIT = 64
COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "triton.")   # where a compiler's own errors come from


@dataclass
class CompileCounts:
    """This process's compile events since the last `take_counts` (logged as sums over ranks)."""
    compile_recompiles: float = 0.0     # compiles of code compiled before
    compile_fallbacks: float = 0.0      # paths that fell back to eager


_counts = CompileCounts()


def take_counts() -> CompileCounts:
    """The counts since the last call, and a fresh start."""
    global _counts
    counts, _counts = _counts, CompileCounts()
    return counts


class Compiled:
    """fn through torch.compile(fn, **options), run eagerly from the first compile that fails (the module
    docstring). path names it in the warning; off is the setting that turns its compile off."""

    def __init__(self, fn: Callable, *, path: str, off: str, **options):
        _watch()
        self.fn, self.path, self.off = fn, path, off
        self.compiled = torch.compile(fn, **options)
        self.eager = False

    def __call__(self, *args, **kwargs):
        if self.eager:
            return self.fn(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - only a compiler's own errors are caught
            if not type(e).__module__.startswith(COMPILER_MODULES):
                raise
            reason = _reason(e)
        self.eager = True
        _counts.compile_fallbacks += 1
        print(f"warning: torch.compile failed for the {self.path} ({reason}); it runs eagerly from now on "
              f"(--{self.off} skips the compile)", file=sys.stderr, flush=True)
        return self.fn(*args, **kwargs)


def _reason(e: Exception) -> str:
    """The compiler's error in a few words: its type and first line (a backend's own error, not dynamo's
    wrapper of it)."""
    if isinstance(e, FailOnRecompileLimitHit):
        return f"dynamo's recompile limit passed: {torch._dynamo.config.recompile_limit} compiles of one function"
    inner = getattr(e, "inner_exception", None) or e                  # BackendCompilerFailed wraps it
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    return f"{type(inner).__name__}: {lines[0][:200] if lines else ''}".rstrip(": ")


def _watch() -> None:
    """Before a compile: the recompile limit raised and made an error (which Compiled turns into its
    fallback); a graph's backward compiled with its forward (not at its first backward, as AOTAutograd may
    otherwise), so that a failure to compile it comes inside Compiled's call, where eager can take over, not
    in the middle of a backward pass; dynamo's compiles counted (again after torch._dynamo.reset(), which
    drops the callback)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    torch._functorch.config.force_non_lazy_backward_lowering = True
    limit_log = logging.getLogger("torch._dynamo.convert_frame")
    if _not_the_limit_warning not in limit_log.filters:
        limit_log.addFilter(_not_the_limit_warning)                     # Compiled's line says it
    if _on_compile not in torch._dynamo.callback_handler.start_callbacks:
        torch._dynamo.callback_handler.register_start_callback(_on_compile)


def _not_the_limit_warning(record: logging.LogRecord) -> bool:
    """dynamo's five-line warning that a function hit the recompile limit: left out, Compiled's line says it."""
    return not str(record.msg).startswith("torch._dynamo hit config.")


def _on_compile(args: CallbackArgs) -> None:
    """dynamo starts compiling a frame: a recompile when that code was compiled before (its compile id
    "frame/n" with n > 0)."""
    compile_id = CompileContext.current_compile_id()
    if args.callback_trigger == CallbackTrigger.DYNAMO and compile_id is not None and compile_id.frame_compile_id:
        _counts.compile_recompiles += 1
