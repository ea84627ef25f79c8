"""Loading checks: the output head pspo can score exactly, the context length, the engine choice; the
settings of how the policy scores (train.compile, model.logprob_head) and compiled decoder layers."""
import os

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from pspo import rollout
from pspo.training.model import ModelError, check_context, check_plain_head


def tiny_qwen2(**overrides) -> Qwen2ForCausalLM:
    config = Qwen2Config(**{"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                            "num_attention_heads": 2, "num_key_value_heads": 1, **overrides})
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
    # Qwen2.5-Math-1.5B: 4096 positions; the released recipes' 512 + 3584 = 4096 just fits.
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


# ---------------------------------------------------------------- compiled decoder layers (train.compile)

def test_compile_and_head_settings_resolve_per_device():
    # auto compiles on CUDA only, and runs the compiled head there; always / never / a named head anywhere
    from pspo.training.config import ConfigError, load_config
    from pspo.training.model import compile_line, compiled_layers, head_mode
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert (compiled_layers("auto", cpu), compiled_layers("auto", cuda)) == (False, True)
    assert (compiled_layers("always", cpu), compiled_layers("never", cuda)) == (True, False)
    assert (head_mode("auto", cpu), head_mode("auto", cuda), head_mode("compiled", cpu)) == ("eager", "compiled",
                                                                                              "compiled")
    assert compile_line("auto", "auto", cpu) == ("scoring: decoder layers eager (train.compile=auto), "
                                                 "log-prob head eager (model.logprob_head=auto)")
    cfg = load_config(None, [])
    assert (cfg.train.attention, cfg.train.compile, cfg.model.logprob_head) == ("auto", "auto", "auto")
    for key, bad in (("train.attention", "flash2"), ("train.compile", "yes"), ("model.logprob_head", "liger")):
        with pytest.raises(ConfigError, match=f"^{key}: expected .* got '{bad}'$"):
            load_config(None, [f"--{key}={bad}"])


def test_every_named_attention_setting_is_a_kernel():
    # the config's names (config.ATTENTIONS) and the kernels packed_attention pins are one list
    from pspo.training.config import ATTENTIONS
    from pspo.training.packed_attention import SDPA_BACKENDS
    assert set(ATTENTIONS) == {"auto", "varlen"} | set(SDPA_BACKENDS)


def _steps(policy, seeds, packing=True):
    """Log-probs and the flat gradient of one update-like pass per seed: 6-9 sequences of random
    lengths (prompts 1-11, completions 1-14 tokens), a new packed-row length each time."""
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_micro_batches import masks
    from pspo.training.micro_batches import plan_micro_batches
    out = []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        n = 6 + seed % 4
        prompts = torch.randint(1, 12, (n,), generator=g).tolist()
        completions = torch.randint(1, 15, (n,), generator=g).tolist()
        P, T = max(prompts), max(completions)
        attention, mask = masks(prompts, completions, P, T)
        ids = torch.randint(3, policy.lm.config.vocab_size, attention.shape, generator=g) * attention
        policy.zero_grad(set_to_none=True)
        logps = []
        for b in plan_micro_batches(attention, mask, 2, 40 if packing else 0, packing):
            logp, _ = policy(b.cut(ids, P), b.cut(attention, P), b.width, 0.7, packed_width=b.length,
                             packed=b.packed)
            (logp * mask[b.rows, :b.width]).sum().backward()
            logps.append(logp.detach().flatten())
        grad = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
        out.append((torch.cat(logps), grad))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_compiled_layers_equal_eager_and_do_not_recompile_per_length(tiny_model_path, checkpointing):
    # train.compile=always on CPU (inductor, ~15-60 s to compile here): the same log-probs and
    # gradients as eager layers within float32 rounding, on packed micro-batches of a new length every
    # step, under gradient checkpointing (which recomputes through the compiled forward: all of it, or
    # under selective checkpointing the layer's non-matmul ops, the CUDA default pair with compile); and
    # after the first step no layer compiles again (dynamic shapes; the per-sequence attention is outside)
    import torch._dynamo
    from torch._dynamo.utils import counters
    from pspo.training.model import build_policy, set_scoring
    from pspo.training.packed_attention import Kernels
    torch._dynamo.reset()
    counters.clear()
    eager, compiled = (build_policy(tiny_model_path, chunk_tokens=64, gradient_checkpointing=checkpointing).train()
                       for _ in range(2))
    set_scoring(compiled, kernels=Kernels("sdpa", "flash"), compiled=True, head="eager")
    set_scoring(eager, kernels=Kernels("sdpa", "flash"), compiled=False, head="eager")
    first = _steps(compiled, [0])
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0                                                   # it compiled
    later = _steps(compiled, [1, 2, 3])
    assert counters["stats"]["unique_graphs"] == graphs                 # no recompile for new lengths
    for (logp, grad), (want_logp, want_grad) in zip(first + later, _steps(eager, [0, 1, 2, 3])):
        torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=0)
        assert float((grad - want_grad).norm() / want_grad.norm()) < 1e-5
    # the parameters keep their names: checkpoints and the engine sync read the same keys
    assert list(compiled.state_dict()) == list(eager.state_dict())


def _layer_compiles(layers: int, monkeypatch, real_compile) -> tuple[list[int], float]:
    """Dynamo's compiled frames after each pass of a `layers`-layer tiny Qwen2 with compiled layers and full
    checkpointing: forward and backward (its recompute) at 7 and then 9 tokens, in train mode with grad, then
    an eval pass without grad; and the recompiles counted (compiled.py). Dynamo's graphs do not depend on
    the backend: its counting backend stands for inductor (milliseconds, not a C++ compile)."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    from pspo.training import model
    from pspo.training.compiled import take_counts
    from pspo.training.packed_attention import Kernels
    torch._dynamo.reset()
    model._compiled.cache_clear()
    take_counts()
    counter = CompileCounter()
    monkeypatch.setattr(torch, "compile", lambda fn, **options: real_compile(fn, backend=counter, **options))
    lm = tiny_qwen2(num_hidden_layers=layers)
    model.enable_checkpointing(lm, "full")
    policy = model.Policy(lm, chunk_tokens=64)
    model.set_scoring(policy, kernels=Kernels("sdpa", "flash"), compiled=True, head="eager")
    frames = []
    for length in (7, 9):
        ids = torch.randint(3, 32, (3, length))
        logp, _ = policy.train()(ids, torch.ones_like(ids), 3, 1.0)
        frames.append(counter.frame_count)
        logp.sum().backward()
        frames.append(counter.frame_count)
    with torch.no_grad():
        policy.eval()(ids, torch.ones_like(ids), 3, 1.0)
    frames.append(counter.frame_count)
    model._compiled.cache_clear()                                       # no counting backend left behind
    torch._dynamo.reset()
    return frames, take_counts().compile_recompiles


@pytest.mark.slow
def test_compiled_layers_compile_the_same_graphs_for_2_and_4_layers(monkeypatch):
    # One graph per kind of pass shared by all layers, not one per layer: a 28-layer model with graphs per
    # layer would pass dynamo's recompile limit and run eagerly. 2 and 4 layers compile the same frames:
    # 1 for the train pass with grad (its recompute in backward and the next length reuse it), then the eval
    # pass without grad; the recompiles counted are the same
    real = torch.compile
    two, four = (_layer_compiles(layers, monkeypatch, real) for layers in (2, 4))
    assert two == four
    frames, recompiles = two
    assert frames[:4] == [1, 1, 1, 1] and frames[4] > 1 and recompiles == frames[4] - 1


@pytest.mark.parametrize("loop", ["static", "generate"])
def test_generation_runs_compiled_layers_eagerly(tiny_model_path, loop):
    # Layers compiled for scoring run eagerly in a pass with a KV cache: transformers' generate, and the
    # static-cache loop's decoding twin (a deep copy of the model, whose layers get the forward bound to
    # themselves, with the twin's own attention). The same tokens as an uncompiled policy; nothing compiled.
    import torch._dynamo
    from torch._dynamo.utils import counters
    from pspo.engines.hf_engine import HFEngine
    from pspo.engines.sampling import sequence_seeds
    from pspo.training.model import build_policy, load_tokenizer, set_scoring
    from pspo.training.packed_attention import Kernels
    torch._dynamo.reset()
    counters.clear()
    tokenizer = load_tokenizer(tiny_model_path)
    ids = [tokenizer(f"{a}+{a + 3}=", add_special_tokens=False)["input_ids"] for a in (12, 40, 7)]
    rollouts = []
    for compiled in (False, True):
        policy = build_policy(tiny_model_path, chunk_tokens=64)
        set_scoring(policy, kernels=Kernels("sdpa", "flash"), compiled=compiled, head="eager")
        engine = HFEngine(policy, tokenizer, batch_size=16, loop=loop)
        rollouts.append(engine.generate(ids, 2, 1.0, 1.0, max_new_tokens=6,
                                        seeds=sequence_seeds(3, 0, torch.arange(3), 2)))
    assert torch.equal(rollouts[0].completion_ids, rollouts[1].completion_ids)
    torch.testing.assert_close(rollouts[0].logprobs, rollouts[1].logprobs, atol=1e-6, rtol=0)
    assert counters["stats"]["unique_graphs"] == 0


def _packed_rows(vocab: int, seed: int):
    """8 sequences of random lengths as left-padded rows: ids, attention (8, P+T), mask (8, T), P."""
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_micro_batches import masks
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, 12, (8,), generator=g).tolist()
    completions = torch.randint(1, 15, (8,), generator=g).tolist()
    attention, mask = masks(prompts, completions, max(prompts), max(completions))
    return torch.randint(3, vocab, attention.shape, generator=g) * attention, attention, mask, max(prompts)


def _half_loss_gradient_step(policy, rows: slice, seed: int) -> None:
    """SGD(lr .02) on the sum of the log-probs of rows (packed micro-batches of at most 40 tokens), halved:
    over two FSDP2 ranks holding half the rows each, the mean of their gradients is the same step (a
    spare micro-batch, which keeps the ranks' collectives matched, adds nothing)."""
    from pspo.training.micro_batches import plan_micro_batches
    ids, attention, mask, P = (x[rows] if isinstance(x, torch.Tensor) else x
                               for x in _packed_rows(policy.lm.config.vocab_size, seed))
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.02)
    for b in plan_micro_batches(attention, mask, 2, 40, True):
        logp, _ = policy(b.cut(ids, P), b.cut(attention, P), b.width, 0.7, packed_width=b.length, packed=b.packed)
        weight = 0.0 if b.spare else 0.5 if rows == slice(None) else 1.0
        ((logp * mask[b.rows, :b.width]).sum() * weight).backward()
    optimizer.step()


def _compiled_fsdp_step_on_rank(rank, init_file, path, out_dir):
    import torch.distributed as dist
    from pspo.training import distributed
    from pspo.training.model import build_policy, set_scoring
    from pspo.training.packed_attention import Kernels
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    policy = build_policy(path, chunk_tokens=64).train()
    set_scoring(policy, kernels=Kernels("sdpa", "flash"), compiled=True, head="eager")
    policy = distributed.shard(policy, 2)                  # compiled, then sharded
    _half_loss_gradient_step(policy, slice(4 * rank, 4 * rank + 4), seed=7)
    state = distributed.full_model_state(policy)
    if rank == 0:
        torch.save(state, f"{out_dir}/state.pt")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)           # as train.py ends a rank (distributed.finish): no interpreter finalization


@pytest.mark.slow
def test_compiled_layers_under_fsdp2_step_like_one_eager_process(tiny_model_path, tmp_path, forked_ranks):
    # compile each decoder layer, then fully_shard it (torchtitan's order): two gloo ranks, each with half
    # of 8 packed sequences, take the step one eager unsharded process takes on all 8 (gradients averaged)
    from pspo.training.model import build_policy
    forked_ranks(_compiled_fsdp_step_on_rank, (str(tmp_path / "init"), tiny_model_path, str(tmp_path)))
    policy = build_policy(tiny_model_path, chunk_tokens=64).train()
    before = {k: v.clone() for k, v in policy.lm.state_dict().items()}
    _half_loss_gradient_step(policy, slice(None), seed=7)
    want, got = policy.lm.state_dict(), torch.load(tmp_path / "state.pt")
    assert set(got) == set(want)
    assert max(float((want[k] - before[k]).abs().max()) for k in want) > 1e-2      # the step moved the weights
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=2e-6, rtol=1e-5)


def test_the_update_bench_records_how_it_scored(tmp_path):
    # bench/micro_batches.py takes the three settings as --attention, --compile and --head (defaults: the
    # config's) and writes what ran into its JSON
    import importlib.util
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("micro_bench", os.path.join(root, "bench", "micro_batches.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "update.json"
    bench.main(["--sequences", "3", "--max-completion", "12", "--max-prompt", "12", "--reps", "1", "--modes",
                "packed", "--attention", "math", "--json", str(out)])
    import json
    got = json.loads(out.read_text())
    assert got["attention"] == "packed rows sdpa math per sequence, unpacked rows sdpa math"
    assert (got["attention_setting"], got["compile_setting"], got["compiled"]) == ("math", "auto", False)
    assert (got["head_setting"], got["head"]) == ("auto", "eager")
