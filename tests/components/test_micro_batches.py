"""Token-budget micro-batches (train.micro_batch_tokens), packed (train.packing) or not: the plan, and
the same update as fixed-size micro-batches (the loss is normalised by global counts, so how the rows are grouped
and how far each group is padded must not change the gradient)."""
import copy
import os

import pytest
import torch

from pspo.loss import OBJECTIVES
from pspo.training.config import load_config
from pspo.training.model import build_policy
from pspo.training.micro_batches import plan_micro_batches
from pspo.training.tokens import batch_inputs
from test_policy_modes import CPU, REWARDS, method_update, rollout_batch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def masks(prompt_lens, completion_lens, P, T):
    """attention (N, P+T) left-padded prompts then completions, and the completion mask (N, T)."""
    attention = torch.zeros(len(prompt_lens), P + T, dtype=torch.long)
    mask = torch.zeros(len(prompt_lens), T)
    for i, (p, c) in enumerate(zip(prompt_lens, completion_lens)):
        attention[i, P - p:P + c] = 1
        mask[i, :c] = 1
    return attention, mask


def test_packing_hand_worked():
    # prompts [3, 1, 2, 2], completions [1, 4, 2, 1]; P = 3, T = 4; budget 10 tokens.
    # lengths p + c = [4, 5, 4, 3] -> longest first (ties keep their order): rows 1, 0, 2, 3.
    #   row 1: 1 x 5 = 5.  + row 0: 2 x 5 = 10 <= 10.  + row 2: 3 x 5 = 15 > 10 -> flush [1, 0]:
    #     cut from 3 - max(1, 3) = 0, completion width max(4, 1) = 4, scored at length 5
    #   row 2: 1 x 4.  + row 3: 2 x 4 = 8 <= 10 -> [2, 3]: cut from 3 - 2 = 1, width 2, length 4
    attention, mask = masks([3, 1, 2, 2], [1, 4, 2, 1], 3, 4)
    plan = plan_micro_batches(attention, mask, 64, 10)
    assert [(b.rows.tolist(), b.start, b.width, b.length, b.spare) for b in plan] == [
        ([1, 0], 0, 4, 5, False), ([2, 3], 1, 2, 4, False)]
    # every real token is inside its micro-batch's cut: nothing is lost by cutting
    for b in plan:
        assert int(b.cut(attention, 3).sum()) == int(attention[b.rows].sum())
    # positions scored (padding-free on the left): 2 x 5 + 2 x 4 = 18 against 4 x 7 = 28 left-padded to P + T
    assert sum(len(b.rows) * b.length for b in plan) == 18
    # micro_batch_tokens = 0: consecutive rows, cut to full width, scored at their longest row
    fixed = plan_micro_batches(attention, mask, 3, 0)
    assert [(b.rows.tolist(), b.start, b.width, b.length) for b in fixed] == [([0, 1, 2], 0, 4, 5), ([3], 0, 4, 3)]


def test_a_row_longer_than_the_budget_goes_alone():
    attention, mask = masks([3, 3], [4, 4], 3, 4)                       # 7 tokens each, budget 5
    plan = plan_micro_batches(attention, mask, 64, 5)
    assert [b.rows.tolist() for b in plan] == [[0], [1]]


# (B, G) the sampler's importance weights, one per prompt as PPS gives them: the update must weigh
# each completion by its prompt's, however the rows are grouped
IS_WEIGHTS = torch.tensor([1.0, 0.5, 2.0, 1.0])[:, None].expand(4, 3)


def updated_parameters(path, batch, overrides, lr=1.0):
    """The policy after one step through methods.py and policy_update with SGD(lr) and no clipping:
    θ - lr·∇L, so equal parameters mean equal gradients. With two iterations (num_iterations = 2) a
    step of lr .1 keeps the second one near π_old: with lr 1 the β·KL term drives its gradient norm
    to ~3000 (15 with lr .1), and the two groupings' parameters then differ by 2e-4 (2e-7 with lr .1)."""
    cfg = load_config("configs/grpo.yaml", ["--optim.max_grad_norm=0", "--rollout.num_generations=3", *overrides])
    policy = build_policy(path, chunk_tokens=64)
    ref = build_policy(path, chunk_tokens=64, trainable=False) if cfg.algo.needs_reference else None
    optimizer = torch.optim.SGD(policy.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    before = copy.deepcopy([p.detach() for p in policy.parameters()])
    sums = method_update(policy, ref, optimizer, scheduler, batch, REWARDS, IS_WEIGHTS, cfg, CPU)
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(policy.parameters(), before))
    return [p.detach().clone() for p in policy.parameters()], sums, moved


@pytest.mark.parametrize("algo", [
    [],                                                                          # GRPO, per-sequence A
    ["--algo.beta=0.04", "--algo.num_iterations=2"],                             # + k3 KL, π_old scored
    ["--algo.advantage=reinforce_pp", "--algo.kl_coef=0.001"],                   # per-token A (N, T)
    ["--algo.aggregation=token_mean"],
])
@pytest.mark.parametrize("packing", ["true", "false"])
def test_token_budget_gives_the_fixed_micro_batches_update(tiny_model_path, algo, packing):
    batch = rollout_batch(tiny_model_path)                                  # 12 sequences
    # the tiny model's completions all run to 6 tokens: end row i after 1 + i % 6 of them (the rest
    # becomes padding), so that lengths spread as they do in real steps
    mask = batch[2].mask
    for i in range(12):
        mask[i, 1 + i % 6:] = 0
    lr = 0.1 if "--algo.num_iterations=2" in algo else 1.0
    fixed, fixed_sums, moved = updated_parameters(tiny_model_path, batch, ["--train.micro_batch_size=4", *algo], lr)
    budget, budget_sums, _ = updated_parameters(
        tiny_model_path, batch, ["--train.micro_batch_tokens=60", f"--train.packing={packing}", *algo], lr)
    assert moved > 1e-4                                                  # the update did something
    for a, b in zip(fixed, budget):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    assert budget_sums.update_tokens == fixed_sums.update_tokens
    # the budget cuts padding: fewer positions than 4-row slices padded to the step's longest; packed, none
    assert budget_sums.update_positions < fixed_sums.update_positions
    assert (budget_sums.update_positions == budget_sums.update_tokens) == (packing == "true")


@pytest.mark.parametrize("objective", [name for name in OBJECTIVES if name != "ppo_clip"])
def test_every_objective_gives_the_fixed_micro_batches_update(tiny_model_path, objective):
    # each objective of docs/methods.md §11 (ppo_clip: above), two iterations so that its ratio has moved on the
    # second (π_old scored; lr .1 as above), a β·KL term: packed token-budget micro-batches, which group and cut the
    # rows otherwise, train exactly as 4-row slices (a sequence-level ratio sees its whole row in either)
    batch = rollout_batch(tiny_model_path)
    mask = batch[2].mask
    for i in range(12):
        mask[i, 1 + i % 6:] = 0
    algo = [f"--algo.objective={objective}", "--algo.num_iterations=2", "--algo.beta=0.04"]
    fixed, fixed_sums, moved = updated_parameters(tiny_model_path, batch, ["--train.micro_batch_size=4", *algo], 0.1)
    packed, packed_sums, _ = updated_parameters(
        tiny_model_path, batch, ["--train.micro_batch_tokens=60", "--train.packing=true", *algo], 0.1)
    assert moved > 1e-5
    for a, b in zip(fixed, packed):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    for key in ("pg_loss", "kl", "ratio", "clipped_tokens", "clipped_seqs", "seqs", "gate"):
        assert getattr(packed_sums, key) == pytest.approx(getattr(fixed_sums, key), rel=1e-5, abs=1e-6), key


# ---------------------------------------------------------------- two FSDP2 ranks with unequal plans

def _update_on_rank(rank, init_file, path, batch, out_dir):
    import torch.distributed as dist
    from pspo.training import distributed
    from pspo.training.distributed import Dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    tokenizer, ids, rollout, _ = batch
    mine = slice(0, 2) if rank == 0 else slice(2, 4)                  # 2 of the 4 prompts each
    rows = slice(3 * mine.start, 3 * mine.stop)                        # their G = 3 completions each
    cfg = load_config("configs/grpo.yaml", ["--optim.max_grad_norm=0", "--rollout.num_generations=3",
                                            "--train.micro_batch_tokens=40"], world_size=2)
    prompts = [p for p in ids[mine] for _ in range(3)]
    _, attention = batch_inputs(prompts, rollout.completion_ids[rows], rollout.mask[rows],
                                tokenizer.pad_token_id)
    plan = plan_micro_batches(attention, rollout.mask[rows], 64, 40, packing=True)     # as the update plans
    policy = distributed.shard(build_policy(path, chunk_tokens=64), 2)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    dist_ = Dist(rank, 2, torch.device("cpu"))
    method_update(policy, None, optimizer, scheduler, batch, REWARDS, IS_WEIGHTS, cfg, dist_, mine)
    state = distributed.full_model_state(policy)
    if rank == 0:
        torch.save({"state": state, "spares": [sum(b.spare for b in plan)]}, f"{out_dir}/rank0.pt")
    else:
        torch.save({"spares": [sum(b.spare for b in plan)]}, f"{out_dir}/rank1.pt")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)           # as train.py ends a rank (distributed.finish): no interpreter finalization


@pytest.mark.slow
def test_two_ranks_with_unequal_micro_batch_counts_step_together(tiny_model_path, tmp_path, forked_ranks):
    batch = rollout_batch(tiny_model_path)
    for i in range(6):                                     # rank 0's rows: 1-token completions -> few micro-batches
        batch[2].mask[i, 1:] = 0
    forked_ranks(_update_on_rank, (str(tmp_path / "init"), tiny_model_path, batch, str(tmp_path)))
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert r0["spares"][0] > 0 and r1["spares"][0] == 0    # rank 0 ran spare micro-batches to match rank 1
    # the same update as one process with fixed micro-batches over all 12 rows
    cfg = load_config("configs/grpo.yaml", ["--optim.max_grad_norm=0", "--rollout.num_generations=3",
                                            "--train.micro_batch_size=4"])
    policy = build_policy(tiny_model_path, chunk_tokens=64)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    method_update(policy, None, optimizer, scheduler, batch, REWARDS, IS_WEIGHTS, cfg, CPU)
    want = {k: v for k, v in policy.lm.state_dict().items()}
    got = r0["state"]
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=2e-6, rtol=1e-5)


def test_skewed_workload_and_mfu_of_the_bench():
    import importlib.util
    spec = importlib.util.spec_from_file_location("micro_bench", os.path.join(ROOT, "bench", "micro_batches.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # matmuls: 6 x 1e9 parameters x 1,000 tokens = 6e12; attention: two sequences of 600 and 400 tokens,
    # 2 layers, query width 128: 6 x 2 x 128 x (600^2 + 400^2) = 1536 x 520,000 = 7.9872e8; sum 6.00079872e12
    flops = bench.update_flops(1_000_000_000, 1_000, [600, 400], 2, 128)
    assert flops == pytest.approx(6.00079872e12, rel=1e-12)
    # plus a head of 1e8 parameters scoring 300 completion tokens: 6 x 1e8 x 300 = 1.8e11
    assert bench.update_flops(1_000_000_000, 1_000, [600, 400], 2, 128, 100_000_000, 300) == \
        pytest.approx(6.00079872e12 + 1.8e11, rel=1e-12)
    # 6e12 FLOPs in 1 s on a 1000 TFLOP/s GPU: 0.006; 9e12 in 0.1 s on 989: 9e13 / 989e12 = 0.0910
    assert abs(bench.mfu(6e12, 1.0, 1000.0) - 0.006) < 1e-15
    assert bench.mfu(9e12, 0.1, 989.0) == pytest.approx(0.0910010, rel=1e-6)
    assert bench.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and bench.peak_tflops("NVIDIA H200") == 989.0
    assert bench.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0 and bench.peak_tflops("NVIDIA L4") is None
    assert bench.peak_tflops("NVIDIA H100 PCIe") == 756.0
    input_ids, attention, mask, advantages, lengths = bench.skewed_batch(48, 100, max_completion=3584, max_prompt=512)
    assert 10 <= int(lengths.min()) and int(lengths.max()) <= 3584 and int(lengths.max()) == mask.shape[1]
    prompts = attention.sum(1) - mask.sum(1)                            # left-padded prompts of 85..512 tokens
    assert int(prompts.min()) >= 512 // 6 and int(prompts.max()) <= 512
    assert torch.equal(mask.sum(1).long(), lengths) and input_ids.shape == attention.shape


def test_profile_summary_of_the_bench():
    import importlib.util
    spec = importlib.util.spec_from_file_location("micro_bench", os.path.join(ROOT, "bench", "micro_batches.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # 100 us of wall time: GEMMs 30 (fp32, the non-tensor-core kind) + 20 (bf16) = 0.5 of it, fp32 0.3;
    # flash attention 0.1; an elementwise kernel 0.15; a Triton kernel 0.05 (other); idle 1 - 0.8 = 0.2.
    kernels = [("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize", 30.0), ("nvjet_tst_192x192_bf16", 20.0),
               ("pytorch_flash::flash_fwd_kernel", 10.0), ("void at::native::vectorized_elementwise_kernel", 15.0),
               ("triton_poi_fused_0", 5.0)]
    shares = bench.profile_shares(kernels, 100.0)
    want = {"gemm": 0.5, "gemm_fp32": 0.3, "attention": 0.1, "elementwise": 0.15, "other": 0.05, "idle": 0.2}
    assert shares == pytest.approx(want)
    assert bench.kernel_kind("fmha_cutlassF_bf16_aligned_64x128") == "attention"        # attention before GEMM
    assert bench.attention_backend(kernels) == "flash"
    assert bench.attention_backend([("fmha_cutlassF_bf16_aligned_64x128", 9.0)]) == "efficient"
    cudnn = ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", 5.0)
    assert bench.attention_backend([cudnn, ("pytorch_flash::flash_bwd", 1.0)]) == "cudnn"
    assert bench.attention_backend(kernels[:2]) == "math"                              # no attention kernel


def _bf16_forward_on_rank(rank, init_file, path, out_dir):
    import torch.distributed as dist
    from pspo.training import distributed
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    policy = distributed.shard(build_policy(path, chunk_tokens=64, bf16=True), 2, bf16=True)
    seen = []
    mlp = policy.lm.model.layers[0].mlp
    mlp.register_forward_pre_hook(lambda module, args: seen.append(module.gate_proj.weight.dtype))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    logp, _ = policy(ids, torch.ones_like(ids), 2, 1.0)
    logp.sum().backward()
    shard = next(p for p in policy.parameters() if p.grad is not None)
    torch.save({"compute": [str(d) for d in seen], "master": str(shard.dtype), "grad": str(shard.grad.dtype),
                "logp": str(logp.dtype)}, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)           # as train.py ends a rank (distributed.finish): no interpreter finalization


@pytest.mark.slow
def test_fsdp_mixed_precision_computes_in_bf16_over_float32_shards(tiny_model_path, tmp_path, forked_ranks):
    # model.bf16 on 2 ranks: FSDP2's MixedPrecisionPolicy all-gathers the float32 shards as bf16 for the
    # forward (a decoder layer's weights are bf16 while it runs), while the shards and their gradients
    # (reduce-scattered in float32) stay float32 for AdamW; the log-probs are float32.
    forked_ranks(_bf16_forward_on_rank, (str(tmp_path / "init"), tiny_model_path, str(tmp_path)))
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["compute"] == ["torch.bfloat16"], got
        assert got["master"] == got["grad"] == got["logp"] == "torch.float32", got
