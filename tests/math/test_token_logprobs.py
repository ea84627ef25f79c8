"""The chunked log-prob head (pspo/training/token_logprobs.py): hand-worked values and gradients, agreement with
a float64 autograd reference, chunking, bf16 precision and what is kept for backward; the same for the
fused head (model.logprob_head=compiled), whose per-chunk functions are checked eagerly here and compiled
in a slow test."""
import pytest
import torch

from pspo.training import token_logprobs as head_module
from pspo.training.token_logprobs import token_logprobs


def _reference(hidden, weight, targets, temperature):
    """Plain float64 log_softmax with autograd: logp (N, T), entropy (N, T)."""
    full = torch.log_softmax(hidden.double() @ weight.double().T / temperature, dim=-1)   # (N, T, V)
    return full.gather(2, targets[..., None]).squeeze(2), -(full.exp() * full).sum(-1)


def _random_head(seed, N=3, T=5, H=8, V=11, dtype=torch.float32, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, T, H, generator=g).to(dtype).requires_grad_()  # (N, T, H)
    # scaled so logits are O(1), as in a trained head: logp ~ -log V, float32 rounding ~1e-7
    weight = (scale * torch.randn(V, H, generator=g)).to(dtype).requires_grad_()  # (V, H)
    targets = torch.randint(0, V, (N, T), generator=g)                     # (N, T)
    upstream = torch.randn(N, T, generator=g)                              # dL/dlogp, (N, T)
    return hidden, weight, targets, upstream


# ---------------------------------------------------------------- hand-worked

@pytest.mark.parametrize("head", ["eager", "compiled"])
def test_values_and_gradients_hand_worked(head, monkeypatch):
    # V = 3, H = 2, W = [[1,0],[0,1],[1,1]]; temperature 1; chunks of one token.
    # token 1: h = (2, 1) -> z = (2, 1, 3), target 0.
    #   lse = 3 + log(1 + e^-1 + e^-2) = 3 + log(1.503215) = 3.407606 -> logp = 2 - 3.407606 = -1.407606
    #   p = softmax(z) = (.244728, .090031, .665241); H = lse - Σ p·z
    #     = 3.407606 - (.489456 + .090031 + 1.995723) = .832396
    #   dlogp/dz = onehot - p = (.755272, -.090031, -.665241)
    #   dlogp/dh = Σ_v (onehot - p)_v W_v = (.755272 - .665241, -.090031 - .665241) = (.090031, -.755272)
    #   dlogp/dW_v = (onehot - p)_v · h, rows: (1.510544, .755272), (-.180062, -.090031),
    #                                          (-1.330482, -.665241)
    # token 2: h = (0, 0) -> z = (0, 0, 0), target 2: logp = -log 3 = -1.098612, H = log 3 = 1.098612
    #   onehot - p = (-1/3, -1/3, 2/3) -> dlogp/dh = (-1/3 + 2/3, -1/3 + 2/3) = (1/3, 1/3)
    #   dlogp/dW_v = (onehot - p)_v · (0, 0) = 0: only token 1 reaches W
    weight = torch.tensor([[1., 0.], [0., 1.], [1., 1.]], requires_grad=True)   # (V=3, H=2)
    hidden = torch.tensor([[[2., 1.], [0., 0.]]], requires_grad=True)            # (N=1, T=2, H=2)
    targets = torch.tensor([[0, 2]])                                             # (1, 2)
    # head "compiled": its per-chunk functions run as written, not compiled (their math, in milliseconds)
    monkeypatch.setattr(head_module, "_compiled", lambda fn: fn)
    logp, entropy = token_logprobs(hidden, weight, targets, temperature=1.0, chunk_tokens=1, head=head)
    torch.testing.assert_close(logp, torch.tensor([[-1.407606, -1.098612]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, torch.tensor([[.832396, 1.098612]]), atol=1e-5, rtol=0)
    logp.sum().backward()
    torch.testing.assert_close(hidden.grad, torch.tensor([[[.090031, -.755272], [1 / 3, 1 / 3]]]),
                               atol=1e-5, rtol=0)
    want_w = torch.tensor([[1.510544, .755272], [-.180062, -.090031], [-1.330482, -.665241]])
    torch.testing.assert_close(weight.grad, want_w, atol=1e-5, rtol=0)


def _logits_123():
    # H = 1, hidden = 1 and weight = [[1],[2],[3]] give logits [1, 2, 3] at every position;
    # targets 0, 1, 2 read the three log-probs.
    hidden = torch.ones(1, 3, 1)                                           # (N=1, T=3, H=1)
    weight = torch.tensor([[1.], [2.], [3.]])                              # (V=3, H=1)
    return hidden, weight, torch.tensor([[0, 1, 2]])                       # targets (1, 3)


def test_temperature_hand_worked():
    hidden, weight, targets = _logits_123()
    # T=1: logsumexp(1,2,3) = 3 + log(1 + e^-1 + e^-2) = 3 + log(1.503215) = 3.407606
    #      logp = [1,2,3] - 3.407606 = [-2.407606, -1.407606, -0.407606]
    #      p = [.090031, .244728, .665241]; H = Σ -p·logp = .216755+.344481+.271160 = .83240
    logp, entropy = token_logprobs(hidden, weight, targets, temperature=1.0)
    torch.testing.assert_close(logp, torch.tensor([[-2.407606, -1.407606, -0.407606]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, torch.full((1, 3), .83240), atol=1e-4, rtol=0)
    # T=2: logits [.5, 1, 1.5]; logsumexp = 1.5 + log(1 + e^-.5 + e^-1) = 1.5 + log(1.974410)
    #      = 1.5 + .680270 = 2.180270 -> logp = [-1.680270, -1.180270, -.680270]
    #      p = [.18632, .30720, .50648]; H = .31307+.36258+.34454 = 1.02019 (flatter: higher)
    logp, entropy = token_logprobs(hidden, weight, targets, temperature=2.0)
    torch.testing.assert_close(logp, torch.tensor([[-1.680270, -1.180270, -0.680270]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, torch.full((1, 3), 1.02019), atol=1e-4, rtol=0)
    assert logp.dtype == torch.float32 and not entropy.requires_grad


def test_large_logits_do_not_overflow():
    # z = (1000, 999, 0): exp(1000) overflows float32, the max-shift does not.
    # lse = 1000 + log(1 + e^-1 + e^-1000) = 1000.313262 -> logp(target 1) = 999 - 1000.313262 = -1.313262
    hidden = torch.ones(1, 1, 1)
    weight = torch.tensor([[1000.], [999.], [0.]])
    logp, entropy = token_logprobs(hidden, weight, torch.tensor([[1]]), temperature=1.0)
    torch.testing.assert_close(logp, torch.tensor([[-1.313262]]), atol=1e-4, rtol=0)
    # p = (.731059, .268941, 0): H = -(.731059·log .731059 + .268941·log .268941) = .582203
    torch.testing.assert_close(entropy, torch.tensor([[.582203]]), atol=1e-4, rtol=0)


# ---------------------------------------------------------------- against autograd in float64

def test_gradcheck_float64():
    # 7 tokens in chunks of 3 (3 + 3 + 1), temperature 0.7, both inputs differentiable.
    hidden, weight, targets, _ = _random_head(4, N=1, T=7, H=3, V=5, dtype=torch.float64, scale=1.0)
    assert torch.autograd.gradcheck(lambda h, w: token_logprobs(h, w, targets, 0.7, chunk_tokens=3)[0],
                                    (hidden, weight))


def test_float64_gradients_equal_autograds():
    hidden, weight, targets, upstream = _random_head(5, dtype=torch.float64, scale=1.0)
    logp, entropy = token_logprobs(hidden, weight, targets, temperature=0.7, chunk_tokens=4)
    (logp * upstream.double()).sum().backward()
    got = logp.detach(), entropy, hidden.grad, weight.grad
    hidden.grad, weight.grad = None, None
    want_logp, want_entropy = _reference(hidden, weight, targets, 0.7)
    (want_logp * upstream.double()).sum().backward()
    for g, w in zip(got, (want_logp.detach(), want_entropy.detach(), hidden.grad, weight.grad)):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.3])
def test_float32_matches_the_float64_reference(temperature):
    hidden, weight, targets, upstream = _random_head(6)
    logp, entropy = token_logprobs(hidden, weight, targets, temperature, chunk_tokens=4)
    (logp * upstream).sum().backward()
    got = logp.detach(), entropy, hidden.grad, weight.grad
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    want_logp, want_entropy = _reference(h64, w64, targets, temperature)
    (want_logp * upstream.double()).sum().backward()
    for g, w in zip(got, (want_logp.detach(), want_entropy.detach(), h64.grad, w64.grad)):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), w, atol=2e-6, rtol=1e-6)     # float32 rounding


def _logp_and_grads(chunk_tokens, seed=0):
    hidden, weight, targets, upstream = _random_head(seed)
    logp, entropy = token_logprobs(hidden, weight, targets, temperature=0.7, chunk_tokens=chunk_tokens)
    (logp * upstream).sum().backward()
    return logp.detach(), entropy, hidden.grad, weight.grad


@pytest.mark.parametrize("chunk_tokens", [1, 4, 7, 15])
def test_chunking_gives_same_logp_and_gradients(chunk_tokens):
    # 15 tokens in chunks of 1, 4 (3 full + 1 of 3), 7 (2 + 1 of 1) or exactly 15 must match one block.
    reference = _logp_and_grads(chunk_tokens=10**6)
    for got, want in zip(_logp_and_grads(chunk_tokens), reference):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_chunk_tokens_must_be_positive():
    hidden, weight, targets, _ = _random_head(0)
    with pytest.raises(ValueError, match="chunk_tokens: expected a positive integer, got 0"):
        token_logprobs(hidden, weight, targets, temperature=1.0, chunk_tokens=0)


# ---------------------------------------------------------------- which inputs take a gradient

def test_gradient_to_one_input_only_and_under_no_grad():
    hidden, weight, targets, upstream = _random_head(7)
    logp, _ = token_logprobs(hidden, weight, targets, temperature=0.7, chunk_tokens=4)
    (logp * upstream).sum().backward()
    want_h, want_w = hidden.grad, weight.grad
    frozen_w = weight.detach()                                             # a frozen head
    h = hidden.detach().requires_grad_()
    (token_logprobs(h, frozen_w, targets, 0.7, 4)[0] * upstream).sum().backward()
    torch.testing.assert_close(h.grad, want_h, atol=1e-6, rtol=0)
    w = weight.detach().requires_grad_()                                   # hidden from a frozen body
    (token_logprobs(hidden.detach(), w, targets, 0.7, 4)[0] * upstream).sum().backward()
    torch.testing.assert_close(w.grad, want_w, atol=1e-6, rtol=0)
    with torch.no_grad():                                                  # scoring π_old / π_ref
        scored, _ = token_logprobs(hidden, weight, targets, 0.7, 4)
    assert not scored.requires_grad
    torch.testing.assert_close(scored, logp.detach(), atol=0, rtol=0)


def test_tied_embeddings_sum_both_gradients():
    # W embeds the input ids and is the head: its gradient is the embedding's plus the head's.
    g = torch.Generator().manual_seed(8)
    V, H = 11, 6
    weight = (0.5 * torch.randn(V, H, generator=g)).requires_grad_()      # (V, H)
    mix = torch.randn(H, H, generator=g)                                   # a stand-in decoder body
    ids = torch.randint(0, V, (2, 5), generator=g)                         # (N, T)
    targets = torch.randint(0, V, (2, 5), generator=g)

    def loss(head):
        hidden = torch.tanh(torch.nn.functional.embedding(ids, weight) @ mix)   # (N, T, H)
        return head(hidden).sum()

    loss(lambda h: token_logprobs(h, weight, targets, 0.7, chunk_tokens=3)[0]).backward()
    got = weight.grad
    weight.grad = None
    loss(lambda h: _reference(h, weight, targets, 0.7)[0].float()).backward()
    torch.testing.assert_close(got, weight.grad, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- bf16

def test_bf16_logits_are_float32_products_of_bf16_operands():
    # Under bf16 autocast (model.bf16) the head's operands are bf16 and the products float32:
    # equal, to float32 rounding, to a float64 head on the bf16-ROUNDED inputs. Logits rounded to
    # bf16 would miss that by ~1e-2 (a logit of 4 is rounded to a multiple of 2^-6).
    hidden, weight, targets, _ = _random_head(9, N=4, T=16, H=64, V=300, scale=0.5)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logp, entropy = token_logprobs(hidden, weight, targets, temperature=0.7, chunk_tokens=24)
    assert logp.dtype == entropy.dtype == torch.float32
    rounded = _reference(hidden.detach().bfloat16(), weight.detach().bfloat16(), targets, 0.7)
    exact = _reference(hidden.detach(), weight.detach(), targets, 0.7)
    torch.testing.assert_close(logp.double(), rounded[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), rounded[1], atol=2e-5, rtol=0)
    # against the unrounded float64 head: within bf16 operand rounding (|z| ~ 4 here, 2^-9 relative)
    torch.testing.assert_close(logp.double(), exact[0], atol=5e-2, rtol=0)
    assert (logp.double() - exact[0]).abs().max() > 1e-4                   # bf16 operands were used
    # bf16 tensors without autocast run the same way; float32 outputs, a bf16 hidden gradient
    h16, w16 = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    logp16, _ = token_logprobs(h16, w16, targets, temperature=0.7, chunk_tokens=24)
    assert logp16.dtype == torch.float32
    torch.testing.assert_close(logp16, logp, atol=1e-5, rtol=0)
    logp16.sum().backward()
    assert h16.grad.dtype == w16.grad.dtype == torch.bfloat16


def test_bf16_gradients_within_bf16_tolerance():
    # float32 master weights and hidden states under autocast, as in Policy.forward with model.bf16:
    # gradients keep their float32 dtype and match the float64 head to bf16 precision.
    hidden, weight, targets, upstream = _random_head(10, N=4, T=16, H=64, V=300, scale=0.5)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logp, _ = token_logprobs(hidden, weight, targets, temperature=0.7, chunk_tokens=24)
    (logp * upstream).sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    (_reference(h64, w64, targets, 0.7)[0] * upstream.double()).sum().backward()
    for got, want in ((hidden.grad, h64.grad), (weight.grad, w64.grad)):
        assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max()


# ---------------------------------------------------------------- memory

def test_nothing_of_vocabulary_size_per_token_is_saved_for_backward():
    # 64 tokens x V = 1000 in one chunk: a plain log_softmax would save a (64 x 1000) block. Saved
    # here: the inputs (64 x 4 hidden, 1000 x 4 weight, 64 targets) and lse (64,).
    hidden, weight, targets, _ = _random_head(11, N=4, T=16, H=4, V=1000)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        logp, _ = token_logprobs(hidden, weight, targets, temperature=1.0, chunk_tokens=64)
    assert sorted(saved) == sorted([(64, 4), (1000, 4), (64,), (64,)]), saved
    logp.sum().backward()                                                  # recomputation works
    assert hidden.grad.abs().sum() > 0 and weight.grad.abs().sum() > 0


# ---------------------------------------------------------------- the fused head (model.logprob_head=compiled)

@pytest.fixture
def fused_uncompiled(monkeypatch):
    """head="compiled" with its per-chunk functions run as written, not compiled: their math, in milliseconds."""
    monkeypatch.setattr(head_module, "_compiled", lambda fn: fn)


@pytest.mark.parametrize("chunk_tokens", [4, 15])
def test_fused_head_matches_float64_and_the_eager_head(fused_uncompiled, chunk_tokens):
    # float64 operands: the fused functions are exact to float64 rounding; float32: to float32 rounding,
    # and to the eager head's numbers up to the order of the sums
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        hidden, weight, targets, upstream = _random_head(12, dtype=dtype, scale=1.0)
        got = {}
        for head in ("eager", "compiled"):
            hidden.grad = weight.grad = None
            logp, entropy = token_logprobs(hidden, weight, targets, 0.7, chunk_tokens, head=head)
            (logp * upstream.to(dtype)).sum().backward()
            got[head] = (logp.detach(), entropy, hidden.grad, weight.grad)
        h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
        want_logp, want_entropy = _reference(h64, w64, targets, 0.7)
        (want_logp * upstream.double()).sum().backward()
        for g, w, e in zip(got["compiled"], (want_logp.detach(), want_entropy.detach(), h64.grad, w64.grad),
                           got["eager"]):
            torch.testing.assert_close(g.double(), w, atol=tolerance, rtol=0)
            torch.testing.assert_close(g, e, atol=tolerance, rtol=0)


def test_fused_head_keeps_the_bf16_contract(fused_uncompiled):
    # under bf16 autocast: float32 logits of bf16 operands (as the eager head), float32 gradients within
    # bf16 tolerance of float64; nothing of vocabulary size saved for backward
    hidden, weight, targets, upstream = _random_head(13, N=4, T=16, H=64, V=300, scale=0.5)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            logp, _ = token_logprobs(hidden, weight, targets, 0.7, chunk_tokens=24, head="compiled")
    assert sorted(saved) == sorted([(64, 64), (300, 64), (64,), (64,)])
    rounded = _reference(hidden.detach().bfloat16(), weight.detach().bfloat16(), targets, 0.7)
    torch.testing.assert_close(logp.double(), rounded[0], atol=2e-5, rtol=0)
    (logp * upstream).sum().backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    (_reference(h64, w64, targets, 0.7)[0] * upstream.double()).sum().backward()
    for got, want in ((hidden.grad, h64.grad), (weight.grad, w64.grad)):
        assert got.dtype == torch.float32 and (got.double() - want).abs().max() <= 2e-2 * want.abs().max()


def test_an_unknown_head_is_refused():
    hidden, weight, targets, _ = _random_head(14)
    with pytest.raises(ValueError, match="head: expected one of eager, compiled, got 'liger'"):
        token_logprobs(hidden, weight, targets, 1.0, head="liger")


@pytest.mark.slow
def test_compiled_head_equals_the_eager_head():
    # the fused functions compiled by inductor (~10-20 s on 2 CPU cores): float32, the eager numbers up to
    # the order of the sums, for chunks of several lengths; dynamic shapes compile any length once, and
    # a one-token chunk once more (dynamo specializes sizes 0 and 1): 15 tokens in chunks of 4 (4, 4, 4, 3)
    # and 7 (7, 7, 1) compile both, then chunks of 15 and 6 (6, 6, 3) compile nothing. bf16 autocast:
    # as close to float64 as the eager head is (bf16 tolerance)
    from torch._dynamo.utils import counters
    for seed, chunk_tokens in ((15, 4), (16, 7), (17, 15), (18, 6)):
        hidden, weight, targets, upstream = _random_head(seed, scale=1.0)
        got = {}
        for head in ("eager", "compiled"):
            hidden.grad = weight.grad = None
            logp, entropy = token_logprobs(hidden, weight, targets, 0.7, chunk_tokens, head=head)
            (logp * upstream).sum().backward()
            got[head] = (logp.detach(), entropy, hidden.grad, weight.grad)
        for g, e in zip(got["compiled"], got["eager"]):
            torch.testing.assert_close(g, e, atol=2e-6, rtol=0)
        if seed == 16:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs                  # no recompile per chunk length
    hidden, weight, targets, upstream = _random_head(19, N=4, T=16, H=64, V=300, scale=0.5)
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    (_reference(h64, w64, targets, 0.7)[0] * upstream.double()).sum().backward()
    gaps = {}
    for head in ("eager", "compiled"):
        hidden.grad = weight.grad = None
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            logp, _ = token_logprobs(hidden, weight, targets, 0.7, chunk_tokens=24, head=head)
        (logp * upstream).sum().backward()
        gaps[head] = [float((g.double() - w).abs().max() / w.abs().max())
                      for g, w in ((hidden.grad, h64.grad), (weight.grad, w64.grad))]
    assert all(c <= 2e-2 and c <= 1.5 * e + 1e-3 for c, e in zip(gaps["compiled"], gaps["eager"])), gaps


# ---------------------------------------------------------------- in the policy

def test_policy_bf16_head_scores_and_trains_a_tied_model():
    # Policy.forward with model.bf16 runs the head under the decoder's bf16 autocast: float32
    # log-probs within bf16 precision of the float32 policy, gradients reaching the tied matrix.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pspo.training.model import Policy
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    lm = Qwen2ForCausalLM(config).eval()
    input_ids = torch.randint(0, 64, (2, 9))                               # (N, P+T)
    attention_mask = torch.ones_like(input_ids)
    want, _ = Policy(lm, chunk_tokens=5)(input_ids, attention_mask, num_completion_tokens=6, temperature=0.7)
    got, entropy = Policy(lm, chunk_tokens=5, bf16=True)(input_ids, attention_mask, num_completion_tokens=6,
                                                          temperature=0.7)
    assert got.dtype == entropy.dtype == torch.float32 and got.shape == (2, 6)
    torch.testing.assert_close(got, want, atol=5e-2, rtol=0)
    got.sum().backward()
    embedding = lm.get_input_embeddings().weight
    assert embedding is lm.get_output_embeddings().weight and embedding.grad.abs().sum() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the bf16 head's cuBLAS call "
                    "(torch.mm with a float32 output) runs only there")
@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize("head", ["eager", "compiled"])
def test_cuda_head_against_float64(bf16, head):
    # On one H100 (2048 tokens x 1536 x 151,936) the bf16 head was within 0.0047 of float64 in log π and
    # 0.5% in its gradients (bench/RESULTS.md §22); float32 (TF32 off by default) within 3e-6.
    torch.manual_seed(0)
    N, T, H, V = 2, 256, 256, 32768
    h = torch.randn(N, T, H, device="cuda") * 0.5
    W = torch.randn(V, H, device="cuda") * 0.05
    y = torch.randint(0, V, (N, T), device="cuda")
    g = torch.randn(N, T, device="cuda", dtype=torch.float64)
    h64, W64 = h.double().requires_grad_(), W.double().requires_grad_()
    want = torch.log_softmax((h64 @ W64.T) / 0.7, -1).gather(-1, y[..., None])[..., 0]
    (want * g).sum().backward()
    h32, W32 = h.clone().requires_grad_(), W.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        logp, _ = token_logprobs(h32, W32, y, 0.7, chunk_tokens=128, head=head)
    (logp * g.float()).sum().backward()
    assert logp.dtype == torch.float32
    tol = 0.02 if bf16 else 1e-4
    assert (logp.double() - want).abs().max() < tol
    for got, ref in ((h32.grad, h64.grad), (W32.grad, W64.grad)):
        assert ((got.double() - ref).abs().max() / ref.abs().max()) < tol
