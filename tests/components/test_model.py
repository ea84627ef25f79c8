"""Loading checks: the output head pspo can score exactly, the context length, the engine choice."""
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from pspo import rollout
from pspo.training.model import ModelError, check_context, check_plain_head


def tiny_qwen2(**overrides) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, **overrides)
    return Qwen2ForCausalLM(config)


def test_a_plain_head_passes():
    check_plain_head(tiny_qwen2())
    check_plain_head(tiny_qwen2(tie_word_embeddings=True))


@pytest.mark.parametrize("key, value", [("final_logit_softcapping", 30.0), ("logit_scale", 0.0625),
                                        ("logits_scaling", 8.0)])
def test_transformed_logits_are_refused_in_one_line(key, value):
    # Gemma 2 soft-caps (30·tanh(z/30)), Cohere multiplies (logit_scale), Granite divides
    # (logits_scaling): hidden @ W^T alone would be a different policy than the model's.
    lm = tiny_qwen2()
    setattr(lm.config, key, value)
    with pytest.raises(ModelError, match=f"sets {key}={value}") as e:
        check_plain_head(lm)
    assert "\n" not in str(e.value)
    setattr(lm.config, key, None if key != "logits_scaling" else 1.0)   # the neutral values pass
    check_plain_head(lm)


def test_a_head_bias_is_refused():
    lm = tiny_qwen2()
    lm.lm_head = torch.nn.Linear(16, 32, bias=True)
    with pytest.raises(ModelError, match="lm_head has a bias"):
        check_plain_head(lm)


def test_context_must_fit_the_models_positions():
    # Qwen2.5-Math-1.5B: 4096 positions; the reference recipes' 512 + 3584 = 4096 just fits.
    config = Qwen2Config(max_position_embeddings=4096)
    check_context(config, 512, 3584)
    with pytest.raises(ModelError) as e:
        check_context(config, 600, 3584)
    assert str(e.value) == ("data.max_prompt_tokens (600) + rollout.max_new_tokens (3584) = 4184 exceeds the "
                            "model's max_position_embeddings (4096); lower one of them")


def test_auto_engine_is_transformers_without_a_gpu(monkeypatch):
    # auto = vLLM where there is a GPU (and vLLM), transformers generate on CPU, installed or not.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rollout.engine_name("auto") == "hf"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rollout.vllm_engine, "vllm_available", lambda: True)
    assert rollout.engine_name("auto") == "vllm"
    monkeypatch.setattr(rollout.vllm_engine, "vllm_available", lambda: False)
    assert rollout.engine_name("auto") == "hf"
    assert rollout.engine_name("hf") == "hf"
    with pytest.raises(ImportError, match="rollout.engine: vllm is not installed"):
        rollout.engine_name("vllm")


def test_a_chat_turns_end_stops_generation_even_when_eos_is_another_token(tiny_model_path):
    # Qwen2.5-Math-1.5B's eos is <|endoftext|> but its ChatML turns end with <|im_end|>: both stop.
    from pspo.training.model import load_tokenizer
    from pspo.training.tokens import stop_token_ids
    tokenizer = load_tokenizer(tiny_model_path)
    vocab = tokenizer.get_vocab()
    tokenizer.eos_token = "<|endoftext|>"
    assert stop_token_ids(tokenizer) == sorted([vocab["<|endoftext|>"], vocab["<|im_end|>"]])
    assert stop_token_ids(tokenizer, [7, vocab["<|im_end|>"]]) == sorted([7, vocab["<|endoftext|>"],
                                                                          vocab["<|im_end|>"]])


def test_a_corrupt_weights_file_is_one_line(tmp_path, tiny_model_path):
    import shutil
    from pspo.training.model import load_causal_lm
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    (folder / "model.safetensors").write_bytes(b"xx")                  # a truncated download
    with pytest.raises(ModelError, match="cannot load a causal LM from .*header too small") as e:
        load_causal_lm(str(folder))
    assert "\n" not in str(e.value)


def test_dropout_is_off_so_train_mode_scores_like_eval_mode():
    # A model configured with attention dropout 0.5: in train mode its log-probs are random
    # unless dropout is disabled, and the update (train mode) would disagree with π_old (eval).
    from pspo.training.model import Policy, disable_dropout
    torch.manual_seed(0)
    lm = tiny_qwen2(attention_dropout=0.5)
    policy = Policy(lm, chunk_tokens=64)
    ids, mask = torch.randint(0, 32, (2, 7)), torch.ones(2, 7, dtype=torch.long)
    eval_logp = policy.eval()(ids, mask, 3)[0]
    assert not torch.allclose(policy.train()(ids, mask, 3)[0], eval_logp)   # dropout active: differs
    disable_dropout(lm)
    torch.testing.assert_close(policy.train()(ids, mask, 3)[0], eval_logp, atol=1e-6, rtol=0)


def test_scoring_is_padding_free_and_equals_each_row_alone(tiny_model_path):
    # Rows of 3, 5 and 1 prompt tokens (left-padded to 5) with 4, 2 and 3 completion tokens (right-padded
    # to 4): the log-probs of Policy.forward, which moves each row's tokens to the start and attends
    # causally without a mask, equal each row scored alone with the model's own logits:
    # log_softmax(logits / T)[next token] at positions p - 1 .. p + c - 2.
    from pspo.training.model import build_policy
    torch.manual_seed(0)
    policy = build_policy(tiny_model_path, chunk_tokens=4)
    V = policy.lm.config.vocab_size
    rows = [(torch.randint(3, V, (p,)), torch.randint(3, V, (c,))) for p, c in ((3, 4), (5, 2), (1, 3))]
    input_ids = torch.zeros(3, 9, dtype=torch.long)
    attention = torch.zeros(3, 9, dtype=torch.long)
    for i, (prompt, completion) in enumerate(rows):
        input_ids[i, 5 - len(prompt):5 + len(completion)] = torch.cat([prompt, completion])
        attention[i, 5 - len(prompt):5 + len(completion)] = 1
    with torch.no_grad():
        logp, _ = policy(input_ids, attention, 4, 0.7)
        for i, (prompt, completion) in enumerate(rows):
            ids = torch.cat([prompt, completion])[None]
            logits = policy.lm(ids).logits[0].float() / 0.7                               # (p + c, V)
            want = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, completion[:, None])[:, 0]
            torch.testing.assert_close(logp[i, :len(completion)], want, atol=1e-5, rtol=1e-5)
            assert torch.isfinite(logp[i]).all()                                          # pads: finite, masked later
