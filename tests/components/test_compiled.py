"""torch.compile's one rule (pspo/training/compiled.py) on each compiled path: a compile that fails runs the
path eagerly with one stderr line naming it and the setting that turns it off, counted in the step's
`compile_fallbacks`, and the run goes on with the eager values; a function's own error is raised;
dynamo's recompile limit is such a failure; recompiles are counted per step (`compile_recompiles`).
A compiler bug is stood for by a backend that raises, as inductor, Triton or the C compiler would
(dynamo wraps it in BackendCompilerFailed): no inductor compile, only dynamo's tracing (the two marked slow
took 7 s each on 2 loaded cores, the others 1.3 s together)."""
import copy

import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from transformers import Qwen2Config, Qwen2ForCausalLM

from pspo.engines.hf_engine import HFEngine
from pspo.engines.sampling import sequence_seeds
from pspo.training import model, token_logprobs
from pspo.training.compiled import Compiled, take_counts
from pspo.training.config import load_config
from pspo.training.metrics import (AdvantageSums, GenerationCounts, MethodStats, RolloutSums, UpdateSums,
                                   step_metrics)
from pspo.training.packed_attention import Kernels

COMPILER_BUG = "C++ compile failed: error: 'vec' was not declared in this scope\n(the compiler's whole output)"


def broken_backend(gm, example_inputs):
    raise RuntimeError(COMPILER_BUG)


def broken_backward(gm, example_inputs):
    """Forward compiles (as written); backward fails: a compiler bug in the backward graph only."""
    def fail(gm, example_inputs):
        raise RuntimeError(COMPILER_BUG)
    return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward), bw_compiler=fail)(gm, example_inputs)


def fresh_compiles() -> None:
    """Nothing compiled in this process: dynamo's caches and the paths' compiled functions dropped."""
    torch._dynamo.reset()
    model._compiled.cache_clear()
    token_logprobs._compiled.cache_clear()
    take_counts()


@pytest.fixture
def backend(monkeypatch):
    """`backend(fn)`: torch.compile runs fn as its backend from now on (the paths' other options kept but
    mode, which names an inductor setting); fresh compiles before and after."""
    real = torch.compile

    def use(fn):
        def compile_with(f, **options):
            options.pop("mode", None)
            return real(f, backend=fn, **options)
        monkeypatch.setattr(torch, "compile", compile_with)
    fresh_compiles()
    yield use
    fresh_compiles()


def tiny_policy(layers: int = 2, checkpointing: str = "none") -> model.Policy:
    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(config)
    model.enable_checkpointing(lm, checkpointing)
    return model.Policy(lm, chunk_tokens=64).train()


def scored(policy: model.Policy, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of 3 rows of `length` tokens (the last 3 scored) and the gradient of their sum."""
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(3, 32, (3, length), generator=g)
    policy.zero_grad(set_to_none=True)
    logp, _ = policy(ids, torch.ones_like(ids), 3, 0.7)
    logp.sum().backward()
    return logp.detach(), torch.cat([p.grad.flatten() for p in policy.parameters()])


def warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning: torch.compile failed")]


@pytest.mark.parametrize("failing", [broken_backend, pytest.param(broken_backward, marks=pytest.mark.slow)],
                         ids=["forward", "backward"])     # backward: AOTAutograd traces both graphs
def test_layers_whose_compile_fails_run_eagerly(backend, capsys, failing):
    # train.compile: the decoder layers' compile fails (the forward graph, or only the backward graph, which
    # compiles with the forward: the failure comes in the call, not in the middle of loss.backward()); the
    # log-probs and gradients are the eager layers', at two lengths; one line, one fallback counted
    backend(failing)
    eager = tiny_policy()
    policy = copy.deepcopy(eager)
    model.set_scoring(policy, kernels=Kernels("sdpa", "flash"), compiled=True, head="eager")
    for length in (7, 9):
        got, want = scored(policy, length), scored(eager, length)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert warnings(capsys.readouterr().err) == [
        "warning: torch.compile failed for the decoder layers (Qwen2DecoderLayer.forward) (RuntimeError: C++ "
        "compile failed: error: 'vec' was not declared in this scope); it runs eagerly from now on "
        "(--train.compile=never skips the compile)"]
    assert take_counts().compile_fallbacks == 1


def test_a_head_whose_compile_fails_runs_eagerly(backend, capsys):
    # model.logprob_head=compiled: both chunk functions fail to compile (statistics in forward, grad_z in
    # backward: inside the head's own backward, where the eager function takes over as well); the values are
    # the fused functions' run eagerly, which equal the eager head's to float32 rounding
    backend(broken_backend)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    weight = torch.randn(40, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (2, 5), generator=g)
    got = {}
    for head in ("eager", "compiled"):
        hidden.grad = weight.grad = None
        logp, entropy = token_logprobs.token_logprobs(hidden, weight, targets, 0.7, chunk_tokens=4, head=head)
        logp.sum().backward()
        got[head] = (logp.detach(), entropy, hidden.grad, weight.grad)
    for a, b in zip(got["compiled"], got["eager"]):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=0)
    assert [line.split(" (RuntimeError")[0] for line in warnings(capsys.readouterr().err)] == [
        "warning: torch.compile failed for the log-prob head (_chunk_stats)",
        "warning: torch.compile failed for the log-prob head (_grad_logits)"]
    assert take_counts().compile_fallbacks == 2


@pytest.mark.slow
def test_a_decoding_step_whose_compile_fails_runs_eagerly(backend, tiny_model_path, capsys):
    # rollout.compile=always: the decoding step's compile fails on its first call; the completions are the
    # eager loop's, a second call warns no more (the sampler is not compiled on CPU)
    backend(broken_backend)
    tokenizer = model.load_tokenizer(tiny_model_path)
    policy = model.build_policy(tiny_model_path, chunk_tokens=64)
    ids = [tokenizer(f"{a}+{a + 3}=", add_special_tokens=False)["input_ids"] for a in (12, 40, 7)]
    seeds = sequence_seeds(7, 0, torch.arange(3), 2)
    compiled = HFEngine(policy, tokenizer, batch_size=8, compile=True)
    eager = HFEngine(policy, tokenizer, batch_size=8)
    eager.decoder.pad_shapes = True                                     # the compiled run's shapes
    for _ in range(2):
        a, b = compiled.generate(ids, 2, 1.0, 1.0, 6, seeds), eager.generate(ids, 2, 1.0, 1.0, 6, seeds)
        assert torch.equal(a.completion_ids, b.completion_ids)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=0, rtol=0)
    assert [line.split(" (RuntimeError")[0] for line in warnings(capsys.readouterr().err)] == [
        "warning: torch.compile failed for the decoding step"]
    assert take_counts().compile_fallbacks == 1


def test_the_functions_own_error_is_raised(backend, capsys):
    # an error of the code itself (dynamo re-raises it as it is): no fallback, no warning, the error itself
    backend("eager")

    def broken(x):
        raise ValueError("a real bug")
    f = Compiled(broken, path="test function", off="x=never")
    with pytest.raises(ValueError, match="a real bug"):
        f(torch.ones(2))
    assert not f.eager and warnings(capsys.readouterr().err) == [] and take_counts().compile_fallbacks == 0


def test_recompiles_are_counted_and_the_recompile_limit_falls_back(backend, capsys, monkeypatch):
    # static shapes: lengths 1, 2, 3 compile 3 times (2 recompiles); dynamo's recompile limit set to 3, a 4th
    # length would run eagerly in silence: here it is a failed compile, its one line (not dynamo's five), and
    # no recompile; then eager, nothing more. The step's metrics log the counts since the last step, as sums.
    backend("eager")
    f = Compiled(lambda x: x * 2 + 1, path="test function", off="x=never", dynamic=False)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 3)
    assert [float(f(torch.ones(n)).sum()) for n in (1, 2, 3)] == [3.0, 6.0, 9.0]
    assert metrics()[:2] == (2, 0)
    assert float(f(torch.ones(4)).sum()) == 12.0 and float(f(torch.ones(5)).sum()) == 15.0
    assert metrics()[:2] == (0, 1) and f.eager
    assert capsys.readouterr().err.splitlines() == [
        "warning: torch.compile failed for the test function (dynamo's recompile limit passed: 3 compiles of one "
        "function); it runs eagerly from now on (--x=never skips the compile)"]
    assert metrics()[:2] == (0, 0)


def metrics() -> tuple[float, float, dict]:
    """(compile_recompiles, compile_fallbacks, every metric) of a step's metrics now."""
    rollout = RolloutSums(completions=1, groups=1, completion_tokens=1, reward=0, reward_sq=0, accuracy=0, format=0,
                          zero_std_groups=1, truncated=0, reward_failures=0)
    update = UpdateSums(**{name: 0 for name in UpdateSums.__dataclass_fields__})
    _, _, m = step_metrics(MethodStats(rollout, AdvantageSums(0, 0, 0)), update, GenerationCounts(),
                           load_config(None, []), torch.device("cpu"))
    return m["compile_recompiles"], m["compile_fallbacks"], m
