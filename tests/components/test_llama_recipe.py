"""The Llama-3.2-1B-Instruct recipe (configs/llama-3.2-1b-instruct/): the Qwen2.5-Math-1.5B recipe with another
model, its CPU stand-in built from the real config.json, and a Llama 3 chat prompt as pspo builds it. Its
presets are rehearsed on CPU with the others (tests/e2e/test_presets.py)."""
import json
import os

from transformers import PreTrainedTokenizerFast

from pspo.offline.standin import build_standin_tokenizer, standin_config
from pspo.tasks.data import format_prompt
from pspo.training.config import load_config, to_dict
from pspo.training.tokens import stop_token_ids

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA, QWEN = (os.path.join(ROOT, "configs", name) for name in ("llama-3.2-1b-instruct", "qwen2.5-math-1.5b"))


def test_the_llama_recipe_is_the_qwen_recipe_with_another_model():
    # grpo.yaml and pspo.yaml: every setting the Qwen recipe's but the model and the output folder
    for preset in ("grpo", "pspo"):
        ours, theirs = (to_dict(load_config(os.path.join(folder, f"{preset}.yaml"))) for folder in (LLAMA, QWEN))
        assert ours["model"].pop("name_or_path") == "meta-llama/Llama-3.2-1B-Instruct"
        assert theirs["model"].pop("name_or_path") == "Qwen/Qwen2.5-Math-1.5B"
        assert ours["train"].pop("output_dir") == f"runs/llama-3.2-1b-instruct-{preset}"
        theirs["train"].pop("output_dir")
        assert ours == theirs


def test_standin_keeps_llamas_gqa_ratio_rope_scaling_and_vocabulary():
    with open(os.path.join(LLAMA, "model_config.json")) as f:
        real = json.load(f)
    small = standin_config(real)
    # 32 query heads / 8 KV heads = ratio 4: 192 / 32 = 6 heads, rounded up to 8 -> 8 x 32 = hidden 256, 2 KV heads
    assert (small["num_attention_heads"], small["num_key_value_heads"], small["hidden_size"]) == (8, 2, 256)
    assert small["head_dim"] == 32 and small["num_hidden_layers"] == 2
    for key in ("vocab_size", "max_position_embeddings", "tie_word_embeddings", "rope_theta", "rope_scaling",
                "rms_norm_eps"):
        assert small[key] == real[key], key
    assert (real["vocab_size"], real["rope_scaling"]["rope_type"]) == (128256, "llama3")


# Llama 3's turn layout (the real template also puts a dated preamble in the system message): a BOS in the
# template's text, headers, <|eot_id|> after each turn
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}")


def test_a_llama3_prompt_has_one_bos_and_its_turn_end_stops_a_completion():
    # pspo formats the problem through the tokenizer's chat template, then tokenizes the text without adding
    # special tokens (data.py: tokenized): the template's BOS is the prompt's only one. The stand-in's
    # tokenizer given Llama 3's special tokens and turn layout:
    base = build_standin_tokenizer(4096)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        additional_special_tokens=["<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"],
        chat_template=LLAMA3_TEMPLATE)
    text = format_prompt(tokenizer, "What is 2 + 3?", "r1")
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert text.endswith("What is 2 + 3?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    # a completion stops at <|eot_id|> (the chat turn's end) as well as at the generation config's ids
    end_of_text, eot = tokenizer.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"])
    assert {end_of_text, eot} <= set(stop_token_ids(tokenizer, [end_of_text]))
