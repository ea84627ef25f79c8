"""Packed micro-batches (train.packing): the first-fit-decreasing packer, and packed rows that give each
sequence the log-probs and gradients it has alone (pspo/training/packed_attention.py, Policy.forward's
packed path), on hand-made lengths: a sequence that fills a row alone, one-token prompts and
completions, an empty completion, rows whose tail is padding."""
import json

import pytest
import torch

from pspo.training.config import ConfigError, load_config
from pspo.training.logprobs import score_logprobs
from pspo.training.micro_batches import first_fit_decreasing, plan_micro_batches
from pspo.training.model import build_policy
from pspo.training.packed_attention import PACKED_ATTENTION, packed_kernel
from test_micro_batches import masks

# prompts and completions (tokens) of 8 sequences in rows of P = 9 prompt and T = 12 completion columns:
# a one-token prompt with a one-token completion, an empty completion, full-length ones (21 tokens: fills
# a 21-token budget alone), and rows whose completion ends early (their tail is padding)
PROMPTS = [9, 1, 4, 7, 2, 9, 5, 1]
COMPLETIONS = [12, 1, 5, 0, 12, 3, 7, 12]
P, T = 9, 12


@pytest.fixture(scope="module")
def policy(tiny_model_path):
    return build_policy(tiny_model_path, chunk_tokens=64)


def rows(vocab: int, seed: int = 0):
    attention, mask = masks(PROMPTS, COMPLETIONS, P, T)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, attention.shape, generator=g) * attention
    return ids, attention, mask


def test_first_fit_decreasing_hand_worked():
    # lengths [5, 3, 7, 2, 4], budget 8; longest first: 7 (i2), 5 (i0), 4 (i4), 3 (i1), 2 (i3)
    #   7 -> new bin A (room 1); 5 -> new bin B (room 3); 4 fits neither (1, 3) -> new bin C (room 4);
    #   3 -> B (room 0); 2 -> A? room 1 < 2, B room 0, C room 4 -> C (room 2)
    assert first_fit_decreasing([5, 3, 7, 2, 4], 8) == [[2], [0, 1], [4, 3]]
    # a sequence over the budget gets a bin of its own, and nothing joins it
    assert first_fit_decreasing([10, 1, 1], 8) == [[0], [1, 2]]
    # ties keep index order: deterministic plans
    assert first_fit_decreasing([2, 2, 2], 4) == [[0, 1], [2]]


def test_packed_plan_sizes_and_no_padding():
    attention, mask = masks(PROMPTS, COMPLETIONS, P, T)
    # sequence lengths p + c: [21, 2, 9, 7, 14, 12, 12, 13]; budget 21: the 21-token one fills a row alone
    plan = plan_micro_batches(attention, mask, 64, 21, packing=True)
    lengths = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    assert [b.rows.tolist() for b in plan] == first_fit_decreasing(lengths, 21)
    assert plan[0].rows.tolist() == [0] and plan[0].packed.tokens == 21
    for b in plan:
        sizes = [lengths[i] for i in b.rows.tolist()]
        assert b.packed.tokens == sum(sizes) <= 21 and b.packed.longest == max(sizes)
        assert b.packed.completion_tokens == sum(COMPLETIONS[i] for i in b.rows.tolist())
        assert b.positions == b.packed.tokens                         # no padding at all
    assert sum(b.positions for b in plan) == sum(lengths) == 90
    # unpacked token budget on the same rows: rows x the longest row of each micro-batch
    unpacked = plan_micro_batches(attention, mask, 64, 21)
    assert all(b.packed is None for b in unpacked)
    assert sum(b.positions for b in unpacked) > 90


@pytest.mark.parametrize("budget", [21, 30, 45, 1000])
def test_packed_log_probs_equal_unpacked(policy, budget):
    ids, attention, mask = rows(policy.lm.config.vocab_size)
    alone = score_logprobs(policy, ids, attention, T=T, temperature=0.7, plan=plan_micro_batches(attention, mask, 1, 0))
    packed = score_logprobs(policy, ids, attention, T=T, temperature=0.7,
                            plan=plan_micro_batches(attention, mask, 64, budget, True))
    assert float(((packed - alone).abs() * mask).max()) < 1e-5                # float32 on CPU
    assert float((packed * (1 - mask)).abs().max()) == 0.0                    # 0 past each completion


def test_packed_gradients_equal_unpacked(policy):
    ids, attention, mask = rows(policy.lm.config.vocab_size, seed=1)
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2)) * mask
    grads = []
    for plan in (plan_micro_batches(attention, mask, 1, 0), plan_micro_batches(attention, mask, 64, 30, True)):
        policy.zero_grad(set_to_none=True)
        for b in plan:
            logp, entropy = policy(b.cut(ids, P), b.cut(attention, P), b.width, 1.0, packed_width=b.length,
                                   packed=b.packed)
            w = weights[b.rows, :b.width]
            ((logp * w).sum() + 0.1 * (entropy * w.abs()).sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None]))
    policy.zero_grad(set_to_none=True)
    assert float((grads[0] - grads[1]).norm() / grads[0].norm()) < 1e-5
    assert float(grads[0].norm()) > 0


def test_packed_bf16_autocast_stays_within_bf16_rounding(tiny_model_path):
    bf16 = build_policy(tiny_model_path, chunk_tokens=64, bf16=True)
    ids, attention, mask = rows(bf16.lm.config.vocab_size)
    alone = score_logprobs(bf16, ids, attention, T=T, temperature=1.0, plan=plan_micro_batches(attention, mask, 1, 0))
    packed = score_logprobs(bf16, ids, attention, T=T, temperature=1.0,
                            plan=plan_micro_batches(attention, mask, 64, 45, True))
    assert float(((packed - alone).abs() * mask).max()) < 0.05                # bf16's rounding, not a bug


def test_the_kernel_choice_and_the_saved_config(policy, tmp_path):
    assert packed_kernel("cuda", torch.bfloat16) == "varlen"
    assert packed_kernel("cuda", torch.float32) == "sdpa per sequence"        # flash needs bf16/fp16
    assert packed_kernel("cpu", torch.bfloat16) == "sdpa per sequence"
    assert policy.lm.config._attn_implementation == PACKED_ATTENTION
    # a checkpoint must load anywhere: the attention name is not written into config.json
    policy.lm.config.save_pretrained(tmp_path)
    assert PACKED_ATTENTION not in (tmp_path / "config.json").read_text()
    assert "attn_implementation" not in json.loads((tmp_path / "config.json").read_text())


def test_packing_is_a_validated_setting():
    assert load_config(None, []).train.packing is True
    assert load_config(None, ["--train.packing=false"]).train.packing is False
    with pytest.raises(ConfigError, match="train.packing"):
        load_config(None, ["--train.packing=maybe"])


def test_packed_gradients_with_checkpointing_and_the_update(tiny_model_path):
    # transformers' gradient checkpointing recomputes each layer in backward with the same keyword
    # arguments: the packed offsets must reach the recomputed attention too
    ckpt = build_policy(tiny_model_path, chunk_tokens=64, gradient_checkpointing=True).train()
    ids, attention, mask = rows(ckpt.lm.config.vocab_size, seed=3)
    grads = []
    for plan in (plan_micro_batches(attention, mask, 1, 0), plan_micro_batches(attention, mask, 64, 30, True)):
        ckpt.zero_grad(set_to_none=True)
        for b in plan:
            logp, _ = ckpt(b.cut(ids, P), b.cut(attention, P), b.width, 1.0, packed_width=b.length, packed=b.packed)
            (logp * mask[b.rows, :b.width]).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in ckpt.parameters() if p.grad is not None]))
    assert float((grads[0] - grads[1]).norm() / grads[0].norm()) < 1e-5


def _causal_per_sequence(q, k, v, bounds, scale):
    """Reference: (S, H, D) queries, (S, Hkv, D) keys/values -> causal attention within each sequence."""
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        o = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1])
        out.append(o.transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("version", ["2.10", "2.13"])
def test_varlen_call_adapts_to_the_torch_version(monkeypatch, version):
    # torch 2.10's varlen_attn takes is_causal and no GQA switch; 2.11+ a (left, right) window and, in
    # 2.13, enable_gqa. A stand-in with each signature (computing what the kernel computes) must get
    # causal attention and, without enable_gqa, repeated KV heads.
    import torch.nn.attention.varlen as varlen
    from pspo.training import packed_attention
    calls = []
    if version == "2.10":
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None):
            calls.append({"is_causal": is_causal, "heads": (query.shape[1], key.shape[1])})
            assert is_causal and query.shape[1] == key.shape[1] and cu_seq_q.dtype == torch.int32
            return _causal_per_sequence(query, key, value, cu_seq_q.tolist(), scale)
    else:
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                 enable_gqa=False):
            calls.append({"window": window_size, "gqa": enable_gqa})
            assert window_size == (-1, 0) and enable_gqa and max_q == 5
            return _causal_per_sequence(query, key, value, cu_seq_q.tolist(), scale)
    monkeypatch.setattr(varlen, "varlen_attn", fake)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(9, 4, 8, generator=g), torch.randn(9, 2, 8, generator=g), torch.randn(9, 2, 8, generator=g)
    offsets = torch.tensor([0, 5, 6, 9])                          # sequences of 5, 1 and 3 tokens
    out = packed_attention._varlen(q, k, v, offsets, 5, 0.5)
    torch.testing.assert_close(out, _causal_per_sequence(q, k, v, [0, 5, 6, 9], 0.5))
    assert len(calls) == 1


def test_packing_refuses_attention_that_would_mix_sequences(tiny_model_path):
    # packed rows rely on the packed attention function; eager attention (or sliding-window layers) would let
    # a sequence attend to the one packed before it: refused in one line at start-up
    from pspo.training.model import ModelError, check_packing
    policy = build_policy(tiny_model_path, chunk_tokens=64)
    train = load_config(None, ["--train.micro_batch_tokens=64"]).train
    check_packing(policy, train)                                            # sdpa -> the packed function
    policy.lm.config._attn_implementation = "eager"
    with pytest.raises(ModelError, match="train.packing: packed sequences need sdpa attention"):
        check_packing(policy, train)
    check_packing(policy, load_config(None, ["--train.micro_batch_tokens=64", "--train.packing=false"]).train)
