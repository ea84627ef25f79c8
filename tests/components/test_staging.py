"""The weight buffer of asynchronous rollouts (engines/staging.py): its layout, the room check, and a stage ->
views round trip bit for bit."""
import os

import pytest
import torch

from pspo.engines.staging import (ALIGN, StagingBuffer, check_room, layout, policy_shapes, row_sums, stage, total_bytes,
                                  views)
from pspo.engines.vllm_engine import full_params
from pspo.training.config import ConfigError
from pspo.training.model import build_policy


def test_layout_offsets_are_aligned_and_sized():
    # float32: (3, 5) = 60 bytes at 0, padded to 64; (7,) = 28 bytes at 64, padded to 128; (2, 2) = 16 at 128
    entries = layout([("a", (3, 5)), ("b", (7,)), ("c", (2, 2))], torch.float32)
    assert [(e.offset, e.nbytes) for e in entries] == [(0, 60), (64, 28), (128, 16)]
    assert total_bytes(entries) == 192 and all(e.offset % ALIGN == 0 for e in entries)
    # bf16 halves the bytes: 30 at 0, 14 at 64, 8 at 128
    assert [(e.offset, e.nbytes) for e in layout([("a", (3, 5)), ("b", (7,)), ("c", (2, 2))], torch.bfloat16)] \
        == [(0, 30), (64, 14), (128, 8)]
    assert total_bytes([]) == 0


def test_check_room_refuses_more_than_free_in_one_line():
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    check_room(1)                                           # nothing is allocated either way
    with pytest.raises(ConfigError) as e:
        check_room(free + 2**30)
    line = str(e.value)
    assert "\n" not in line and line.startswith("rollout.mode: async stages the weights in /dev/shm")
    assert "--shm-size" in line and "model.lora.rank" in line


def test_buffer_too_small_for_the_tmpfs_is_a_config_error(tmp_path):
    st = os.statvfs("/dev/shm")
    with pytest.raises(ConfigError, match="rollout.mode: async stages the weights"):
        StagingBuffer(st.f_bavail * st.f_frsize + 2**30)   # posix_fallocate: ENOSPC, not a SIGBUS later
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"pspo-{os.getpid()}-")]


def test_stage_then_views_round_trip_bit_for_bit(tiny_model_path):
    policy = build_policy(tiny_model_path, chunk_tokens=2048)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 1e-3)                  # not the file's weights
    entries = layout(policy_shapes(policy.lm, lora=False), torch.float32)
    buffer = StagingBuffer(total_bytes(entries))
    try:
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"pspo-{os.getpid()}-")]   # unlinked
        seconds, sums = stage(buffer.flat, full_params(policy.lm), entries, sums=True)
        assert seconds >= 0
        staged = dict(views(buffer.flat, entries))
        theirs = dict(full_params(policy.lm))
        assert list(staged) == list(theirs)                      # in order
        for name, t in theirs.items():
            assert torch.equal(staged[name], t), name
            assert torch.equal(sums[name], row_sums(t))
        # bf16 staging rounds as .to(bfloat16) does
        half = layout(policy_shapes(policy.lm, lora=False), torch.bfloat16)
        stage(buffer.flat, full_params(policy.lm), half)
        name, t = next(full_params(policy.lm))
        assert torch.equal(dict(views(buffer.flat, half))[name], t.to(torch.bfloat16))
        with pytest.raises(ValueError, match="staging: expected"):
            stage(buffer.flat, iter([("x", t)]), entries)
    finally:
        buffer.close()


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_head_is_staged_once(tied):
    # Qwen2, vocab 100, hidden 16, one layer (MLP 32, 2 heads x 8, 1 KV head): embedding 100 x 16 = 1,600; the
    # layer: q 16x16 + 16 = 272, k and v 8x16 + 8 = 136 each, o 256, gate, up, down 512 each, 2 norms 32 = 2,368;
    # the final norm 16: 3,984 parameters, 15,936 bytes in float32. Tied, the head is the embedding's tensor: staged
    # once (3,984), not again as lm_head.weight; untied it is a parameter of its own, 1,600 more (5,584, 22,336 B)
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(Qwen2Config(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied))
    assert (lm.lm_head.weight is lm.model.embed_tokens.weight) == tied
    entries = layout(policy_shapes(lm, lora=False), torch.float32)
    names = [e.name for e in entries]
    assert ("lm_head.weight" in names) == (not tied) and names.count("model.embed_tokens.weight") == 1
    assert sum(e.nbytes for e in entries) == (15_936 if tied else 22_336)
    buffer = StagingBuffer(total_bytes(entries))
    try:
        stage(buffer.flat, full_params(lm), entries)                    # full_params yields the same tensors
        staged = dict(views(buffer.flat, entries))
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"      # where the head's values are
        assert torch.equal(staged[head], lm.lm_head.weight)
    finally:
        buffer.close()
