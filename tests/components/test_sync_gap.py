"""The sync check without vLLM: the log-prob gap on a stand-in engine and trainer with hand-set log-probs, and
the weight checksums (integer row sums) on stand-in engine weights: fused, padded, rounded to bf16, LoRA."""
import pytest
import torch

from pspo.training.tokens import Rollout
from pspo.engines.process import stale_rows
from pspo.engines.vllm_engine import (SyncError, adapter_rows, engine_rows, row_sums, stale_engine, sync_gap,
                                      weight_rows)


class FakeEngine:
    pad_id = 0

    def generate(self, prompt_ids, n, temperature, top_p, max_new_tokens, seeds):
        assert n == 1 and top_p == 1.0                 # one fresh completion per prompt, at top_p 1
        ids = torch.tensor([[5, 6, 0], [7, 8, 9]])
        mask = torch.tensor([[1., 1, 0], [1, 1, 1]])   # first completion has 2 tokens, second 3
        logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
        return Rollout(ids, mask, logprobs, torch.tensor([False, True]), ["", ""], 0.0)


class FakePolicy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask, T, temperature):
        # trainer log-probs: differ by .1, .3 on row 0 and 0, .2, .4 on row 1; -9 on the padding
        return torch.tensor([[-1.1, -1.7, -9.0], [-0.5, -0.7, -0.1]]), None


def test_sync_gap_hand_worked():
    # |Δ| over the 5 masked tokens: .1, .3, 0, .2, .4 -> max .4, mean 1.0 / 5 = .2 (padding ignored)
    gap_max, gap_mean = sync_gap(FakeEngine(), FakePolicy(), [[1, 2], [3]], temperature=0.7, max_new_tokens=3,
                                 seeds=torch.zeros(2, dtype=torch.long))
    assert abs(gap_max - 0.4) < 1e-6 and abs(gap_mean - 0.2) < 1e-6


def test_row_sums_hand_worked():
    # float32 bits as int32: 1.0 = 0x3F800000 = 1,065,353,216; -2.0 = 0xC0000000 = -1,073,741,824; 0.5 = 0x3F000000
    # = 1,056,964,608. Rows [1, -2] and [.5, 0]: 1,065,353,216 - 1,073,741,824 = -8,388,608 and 1,056,964,608.
    t = torch.tensor([[1.0, -2.0], [0.5, 0.0]])
    assert row_sums(t).tolist() == [-8_388_608, 1_056_964_608]
    # bf16 as int16: 1.0 = 0x3F80 = 16,256; -2.0 = 0xC000 = -16,384; 1 + 2^-7 (one bf16 ulp up) = 16,257. A 1-D
    # tensor's rows are its elements; concatenating tensors along dim 0 concatenates their sums.
    b = torch.tensor([1.0, -2.0, 1.0 + 2**-7]).to(torch.bfloat16)
    assert row_sums(b).tolist() == [16_256, -16_384, 16_257]
    assert row_sums(torch.cat([t, t[:1]])).tolist() == row_sums(t).tolist() + [-8_388_608]
    # integer sums do not depend on the order: the same rows reversed give the same sums
    r = torch.randn(3, 1000)
    assert row_sums(r.flip(1)).tolist() == row_sums(r).tolist()


def fake_engine(trainer: dict, dtype=torch.float32):
    """What _engine_row_sums returns for `trainer`'s weights loaded by vLLM: q, k, v fused into qkv_proj in that
    order, the embedding padded to 4 rows (vLLM pads the vocabulary), the tied head held once (as the embedding),
    down_proj packed away (the CPU backend: not held)."""
    qkv = torch.cat([trainer[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]).to(dtype)
    embed = torch.cat([trainer["model.embed_tokens.weight"], torch.zeros(1, 2)]).to(dtype)
    return ({"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]},
            {"model.layers.0.self_attn.qkv_proj.weight": (dtype, row_sums(qkv)),
             "model.embed_tokens.weight": (dtype, row_sums(embed))})


def trainer_weights():
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(3, 2, generator=g)
    return {"model.layers.0.self_attn.q_proj.weight": torch.randn(2, 2, generator=g),
            "model.layers.0.self_attn.k_proj.weight": torch.randn(1, 2, generator=g),
            "model.layers.0.self_attn.v_proj.weight": torch.randn(1, 2, generator=g),
            "model.layers.0.mlp.down_proj.weight": torch.randn(2, 2, generator=g),
            "model.embed_tokens.weight": embed, "lm_head.weight": embed}


def test_weight_rows_compare_fused_padded_and_rounded_weights():
    # compared: qkv's 2 + 1 + 1 rows and the embedding's 3 (its padding row is not the trainer's); the tied head
    # and the packed-away down_proj are not held by the engine
    trainer = trainer_weights()
    packed, engine = fake_engine(trainer)
    assert weight_rows(packed, engine, iter(trainer.items())) == (0, 7)
    stepped = dict(trainer, **{"model.layers.0.self_attn.k_proj.weight": trainer[
        "model.layers.0.self_attn.k_proj.weight"] + torch.tensor([[0.0, 1e-6]])})
    assert weight_rows(packed, engine, iter(stepped.items())) == (1, 7)        # one element of k: k's row
    # a LoRA policy's base layer is named .base_layer. in the trainer; its adapters are not compared here
    lora = {k.replace("q_proj.", "q_proj.base_layer."): v for k, v in trainer.items()}
    lora["model.layers.0.self_attn.q_proj.lora_A.default.weight"] = torch.ones(4, 2)
    assert weight_rows(packed, engine, iter(lora.items())) == (0, 7)
    # a bf16 engine holds the weights rounded (round to nearest even, as vLLM's loader copies them): 1 + 2^-9 is
    # below half a bf16 ulp at 1 (2^-8), so that step leaves the engine's weights, and the check, unchanged;
    # 1 + 2^-7 is one ulp: k's row differs
    trainer["model.layers.0.self_attn.k_proj.weight"] = torch.tensor([[1.0, -2.0]])
    packed, engine = fake_engine(trainer, torch.bfloat16)
    for delta, differ in ((2**-9, 0), (2**-7, 1)):
        stepped = dict(trainer, **{"model.layers.0.self_attn.k_proj.weight": torch.tensor([[1.0 + delta, -2.0]])})
        assert weight_rows(packed, engine, iter(stepped.items())) == (differ, 7)


def test_engine_rows_cut_fused_weights_into_the_trainers_parts():
    # an engine process answers its sums under the trainer's names: qkv_proj's 4 row sums are q's 2, then k's 1,
    # then v's 1; the embedding's first 3 (the 4th is vLLM's padding); no tied head, no packed-away down_proj.
    # Compared with the trainer's own sums (process.stale_rows) they give weight_rows's count: 0 of 7 rows
    trainer = trainer_weights()
    packed, engine = fake_engine(trainer)
    qkv = engine["model.layers.0.self_attn.qkv_proj.weight"][1]
    rows = engine_rows(packed, engine, [(n, tuple(t.shape)) for n, t in trainer.items()])
    assert sorted(rows) == sorted(n for n in trainer if "down_proj" not in n and n != "lm_head.weight")
    assert rows["model.layers.0.self_attn.q_proj.weight"].tolist() == qkv[:2].tolist()
    assert rows["model.layers.0.self_attn.k_proj.weight"].tolist() == qkv[2:3].tolist()
    assert rows["model.layers.0.self_attn.v_proj.weight"].tolist() == qkv[3:].tolist()
    expected = {n: row_sums(t) for n, t in trainer.items()}
    assert stale_rows(expected, rows) == (0, 7)
    expected["model.layers.0.self_attn.k_proj.weight"] = row_sums(trainer["model.layers.0.self_attn.k_proj.weight"]
                                                                  + torch.tensor([[0.0, 1e-6]]))
    assert stale_rows(expected, rows) == (1, 7)                                # k's one row
    del trainer["model.layers.0.self_attn.v_proj.weight"]                      # a fused weight missing a part
    with pytest.raises(SyncError, match="qkv_proj.weight has no counterpart"):
        engine_rows(packed, engine, [(n, tuple(t.shape)) for n, t in trainer.items()])


def test_an_engine_weight_without_counterpart_cannot_be_checked():
    trainer = trainer_weights()
    packed, engine = fake_engine(trainer)
    engine["model.layers.0.self_attn.rotary.weight"] = (torch.float32, torch.zeros(2, dtype=torch.long))
    with pytest.raises(SyncError, match=r"rollout.sync_check_steps: the engine's weight "
                                        r"model.layers.0.self_attn.rotary.weight has no counterpart") as e:
        weight_rows(packed, engine, iter(trainer.items()))
    assert "\n" not in str(e.value)
    del trainer["model.layers.0.self_attn.v_proj.weight"]                     # a fused weight missing a part
    with pytest.raises(SyncError, match="qkv_proj.weight has no counterpart"):
        weight_rows(*fake_engine(trainer_weights()), iter(trainer.items()))


def test_adapter_rows_hand_worked():
    # q_proj's A (2 x 3) and B (3 x 2); peft's file names them without the adapter's name ("default")
    A = torch.arange(6.0).reshape(2, 3)
    B = torch.zeros(3, 2)
    names = [f"model.layers.0.self_attn.q_proj.lora_{m}.default.weight" for m in "AB"]
    file = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": A.clone(),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": B.clone()}
    assert adapter_rows(file, iter(zip(names, (A, B)))) == (0, 5)              # 2 rows of A + 3 of B, all equal
    B[1, 0] = 1e-7                                                           # a step the served file lacks
    assert adapter_rows(file, iter(zip(names, (A, B)))) == (1, 5)
    assert adapter_rows({}, iter(zip(names, (A, B)))) == (5, 5)              # nothing served under these names
    # no version served yet: the engine serves the base, right while B = 0; B's row 1 is not 0
    assert adapter_rows(None, iter(zip(names, (A, torch.zeros(3, 2))))) == (0, 3)
    assert adapter_rows(None, iter(zip(names, (A, B)))) == (1, 3)


def test_a_stale_engine_stops_with_one_line():
    assert stale_engine({"weight_sync_s": 0.1}, 3) is None                   # no check this step
    assert stale_engine({"sync_stale_rows": 0.0, "sync_gap_mean": 0.5}, 10) is None      # the gap is only logged
    e = stale_engine({"sync_stale_rows": 1234.0, "sync_gap_mean": 1e-7}, 10)
    assert isinstance(e, SyncError) and "\n" not in str(e)
    assert str(e).startswith("rollout.sync_check_steps: at step 10 the engine's weights differ from the trainer's "
                             "in 1234 rows")
