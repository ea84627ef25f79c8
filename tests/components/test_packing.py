"""Packed micro-batches (train.packing): the first-fit-decreasing packer, and packed rows that give each
sequence the log-probs and gradients it has alone (pspo/training/packed_attention.py, Policy.forward's
packed path), on hand-made lengths: a sequence that fills a row alone, one-token prompts and
completions, an empty completion, rows whose tail is padding. The attention kernels chosen once at
start-up (train.attention): the probe, the refusal of a kernel that does not run, no fallback in the hot
path, no mask built and nothing read back from the device while scoring."""
import json

import pytest
import torch

from pspo.training.config import ConfigError, load_config
from pspo.training.logprobs import score_logprobs
from pspo.training.micro_batches import first_fit_decreasing, plan_micro_batches
from pspo.training.model import build_policy
from pspo.training import packed_attention
from pspo.training.model import set_scoring
from pspo.training.packed_attention import PACKED_ATTENTION, Kernels, choose_kernels, pin_kernels
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
        assert b.packed.lengths == tuple(sizes) and b.packed.tokens == sum(sizes) <= 21
        assert b.packed.bounds.tolist() == [0, *torch.tensor(sizes).cumsum(0).tolist()]   # on the host
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
    # Float32 on CPU: the two paths round differently (attention sums over other lengths, other matmul
    # blockings). log p = z/τ - lse is a difference of two numbers of the size of max|log p| (16 here), and each
    # path carries a relative error of a few u = 2^-24 (float32's unit roundoff) per layer: measured, the
    # unpacked path is 7.6e-6 = 8u x 16 from a float64 run, and the two paths up to 1.05e-5 apart (a machine's
    # build of the tiny model: builds differ across CPUs). Each within 16u x max|log p| -> apart by at most
    # 32u x max|log p| = 3.1e-5 here; a packing bug (attention across sequences, positions off) moves log-probs
    # by orders of magnitude more.
    scale = float((alone.abs() * mask).max())
    assert float(((packed - alone).abs() * mask).max()) < 32 * 2**-24 * scale
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


def test_the_saved_config_names_no_attention(policy, tmp_path):
    assert policy.lm.config._attn_implementation.startswith(PACKED_ATTENTION)
    # a checkpoint must load anywhere: the attention name is not written into config.json
    policy.lm.config.save_pretrained(tmp_path)
    assert PACKED_ATTENTION not in (tmp_path / "config.json").read_text()
    assert "attn_implementation" not in json.loads((tmp_path / "config.json").read_text())


HEADS = {"heads": 4, "kv_heads": 2, "head_dim": 32}       # the tiny model's attention shape
CPU = torch.device("cpu")


def test_auto_on_cpu_pins_sdpa_flash_per_sequence():
    # torch 2.13's CPU build has a flash sdpa kernel (the one sdpa picks by default here), and varlen
    # is CUDA only: auto probes flash and keeps it, for packed rows (per sequence) and unpacked ones
    for bf16 in (False, True):
        assert choose_kernels("auto", device=CPU, bf16=bf16, **HEADS) == Kernels("sdpa", "flash")
    assert choose_kernels("math", device=CPU, bf16=False, **HEADS) == Kernels("sdpa", "math")


@pytest.mark.parametrize("setting", ["varlen", "efficient", "cudnn"])
def test_a_named_kernel_that_does_not_run_is_refused_in_one_line(setting):
    # varlen and the efficient and cuDNN kernels have no CPU implementation: their probes fail, and the
    # run stops at start-up with one line naming the key (train.py turns ConfigError into exit code 2)
    with pytest.raises(ConfigError, match=f"^train.attention: {setting} does not run on cpu in float32 "
                                          r"\(.+\); use auto$") as e:
        choose_kernels(setting, device=CPU, bf16=False, **HEADS)
    assert "\n" not in str(e.value)


def test_auto_takes_the_first_candidate_whose_probe_passes(monkeypatch):
    # the order on a GPU in bf16: varlen (else sdpa per sequence) for packed rows; flash, efficient,
    # then math for unpacked rows and per sequence. The probes' answers stand in for a GPU's.
    refused: set = set()
    monkeypatch.setattr(packed_attention, "_probe_once", lambda k, *a: "refused" if k in refused else None)
    cuda = torch.device("cuda")
    assert choose_kernels("auto", device=cuda, bf16=True, **HEADS) == Kernels("varlen", "flash")
    assert choose_kernels("auto", device=cuda, bf16=False, **HEADS) == Kernels("sdpa", "flash")  # varlen: bf16
    refused |= {Kernels("varlen", "flash")}
    assert choose_kernels("auto", device=cuda, bf16=True, **HEADS) == Kernels("sdpa", "flash")
    refused |= {Kernels("sdpa", "flash")}
    assert choose_kernels("auto", device=cuda, bf16=True, **HEADS) == Kernels("varlen", "efficient")
    refused |= {Kernels("sdpa", "efficient")}
    assert choose_kernels("auto", device=cuda, bf16=False, **HEADS) == Kernels("sdpa", "math")
    assert choose_kernels("cudnn", device=cuda, bf16=True, **HEADS) == Kernels("sdpa", "cudnn")   # named


def test_the_probe_catches_a_kernel_that_computes_something_else(monkeypatch):
    # a stand-in varlen kernel that computes what the real one does passes the probe; one that lets the
    # packed sequences see each other (no causal mask across the row) is caught by its numbers
    def right(q, k, v, offsets, longest, scale):
        return _causal_per_sequence(q, k, v, offsets.tolist(), scale)

    def mixes(q, k, v, offsets, longest, scale):
        return _causal_per_sequence(q, k, v, [0, q.shape[0]], scale)            # one sequence: wrong
    monkeypatch.setattr(packed_attention, "_varlen", right)
    assert packed_attention.probe(Kernels("varlen", "flash"), device=CPU, dtype=torch.float32, **HEADS) is None
    monkeypatch.setattr(packed_attention, "_varlen", mixes)
    reason = packed_attention.probe(Kernels("varlen", "flash"), device=CPU, dtype=torch.float32, **HEADS)
    assert reason.startswith("output differs from float32 math by")


def test_a_kernel_failing_mid_run_is_not_caught(tiny_model_path, monkeypatch):
    # no fallback in the hot path: an error in the pinned kernel (an out-of-memory error, say) stops the
    # forward pass, every time, instead of switching this process to another kernel for good
    policy = build_policy(tiny_model_path, chunk_tokens=64)
    set_scoring(policy, kernels=Kernels("varlen", "flash"), compiled=False, head="eager")
    calls = []

    def out_of_memory(*args):
        calls.append(1)
        raise RuntimeError("CUDA out of memory. Tried to allocate 13.00 GiB")
    monkeypatch.setattr(packed_attention, "_varlen", out_of_memory)
    ids, attention, mask = rows(policy.lm.config.vocab_size)
    plan = plan_micro_batches(attention, mask, 64, 1000, True)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="out of memory"):
            score_logprobs(policy, ids, attention, T=T, temperature=1.0, plan=plan)
    assert len(calls) == 2


def _reads(monkeypatch, allowed: list) -> list[str]:
    """Patches Tensor's read-backs (tolist, item, bool, int, float, index, numpy): each call on a tensor
    other than those in `allowed` is recorded. On a GPU each would make the host wait for the device."""
    seen: list[str] = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy"):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            if not any(self is a for a in allowed):
                seen.append(f"{_name} {tuple(self.shape)}")
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, spy)
    return seen


@pytest.mark.parametrize("packing", [True, False])
def test_scoring_builds_no_mask_and_reads_nothing_back(tiny_model_path, monkeypatch, packing):
    # A packed row of S tokens with a 2-D all-ones mask made transformers read the mask back from the
    # device once per forward pass (and, under tracing, build a (1, 1, S, S) mask: 13 GB at S = 114,688),
    # and the per-sequence attention read the offsets back in every layer (the path a GPU takes without
    # bf16). Now: no mask function is called, even as if traced, and nothing is read back from the
    # device in the forward and backward passes but the host-side offsets given to the attention.
    import transformers.masking_utils as masking_utils
    policy = build_policy(tiny_model_path, chunk_tokens=64)
    ids, attention, mask = rows(policy.lm.config.vocab_size, seed=4)
    plan = plan_micro_batches(attention, mask, 64, 1000 if packing else 0, packing)
    host_bounds: list = []                                  # what the attention was given on the host
    real_attention = packed_attention.attention

    def recording(*args, **kwargs):
        if "cu_seq_lens_host" in kwargs:
            host_bounds.append(kwargs["cu_seq_lens_host"])
        return real_attention(*args, **kwargs)
    monkeypatch.setattr(packed_attention, "attention", recording)
    kernels = Kernels("sdpa", "flash")
    set_scoring(policy, kernels=kernels, compiled=False, head="eager")
    masks_built = []
    real_mask = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS[kernels.name]
    monkeypatch.setitem(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, kernels.name,
                        lambda *a, **k: masks_built.append(k.get("q_length")) or real_mask(*a, **k))
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices",
                        lambda *a: masks_built.append("packed sequences") or None)
    monkeypatch.setattr(masking_utils, "is_tracing", lambda *a: True)        # as if compiled whole
    seen = _reads(monkeypatch, host_bounds)
    for b in plan:
        logp, entropy = policy(b.cut(ids, P), b.cut(attention, P), b.width, 1.0, packed_width=b.length,
                               packed=b.packed)
        (logp * mask[b.rows, :b.width]).sum().backward()
    monkeypatch.undo()
    pin_kernels(policy.lm, kernels)                         # the real attention again under that name
    assert masks_built == [] and seen == []
    assert len(host_bounds) == (len(plan) * policy.lm.config.num_hidden_layers if packing else 0)
    assert float(logp.detach().abs().sum()) > 0                              # it did score


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


def _bench(name: str):
    import importlib.util
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_numerics_bench_says_whether_packing_adds_error(tmp_path):
    # packed_ok, which the GPU check reads: float32, packed within 1e-4 of unpacked; bf16, packed's gaps to
    # float32 at most twice unpacked's plus 1e-2. A packing bug moves log-probs by O(1) nats.
    bench = _bench("attention_numerics")
    fp32 = {"bf16": False, "logp_gap_packed_vs_fp32": (2e-6, 1e-7), "grad_rel_packed_vs_fp32": 1e-6,
            "logp_gap_default_vs_fp32": (2e-6, 1e-7), "grad_rel_default_vs_fp32": 1e-6,
            "logp_gap_packed_vs_unpacked": (9e-5, 1e-6), "grad_rel_packed_vs_unpacked": 5e-5}
    assert bench.packed_ok(fp32)
    assert not bench.packed_ok({**fp32, "logp_gap_packed_vs_unpacked": (2e-4, 1e-6)})
    bf16 = {**fp32, "bf16": True, "logp_gap_default_vs_fp32": (0.05, 0.004), "grad_rel_default_vs_fp32": 0.01,
            "logp_gap_packed_vs_fp32": (0.10, 0.005), "grad_rel_packed_vs_fp32": 0.02}
    assert bench.packed_ok(bf16)                             # 0.10 <= 2 x 0.05 + 0.01, 0.02 <= 0.03
    assert not bench.packed_ok({**bf16, "logp_gap_packed_vs_fp32": (1.3, 0.2)})
    assert not bench.packed_ok({**bf16, "grad_rel_packed_vs_fp32": float("nan")})
    # a run on the tiny model (float32, CPU): packed forward and backward agree, and the JSON says so
    figures = bench.main(["--rows", "3", "--max-len", "24", "--budget", "40", "--json", str(tmp_path / "n.json")])
    saved = json.loads((tmp_path / "n.json").read_text())
    assert saved["packed_ok"] is True and figures["packed_ok"] is True
    assert saved["packed_kernel"] == "sdpa flash per sequence" and saved["attention_setting"] == "auto"
    assert saved["logp_gap_packed_vs_unpacked"][0] < 1e-4 and saved["grad_rel_packed_vs_unpacked"] < 1e-4
