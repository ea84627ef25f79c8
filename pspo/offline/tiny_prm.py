"""The offline process reward model (`prm.model: builtin:tiny-prm`): a 3-class step classifier built in
code in a few seconds, so that PSPO*'s reward (docs/related.md §C) runs on a laptop CPU and in the tests.

It has the released PSPO* PRM's interface: an AutoModelForSequenceClassification (here a 2-layer BERT of ~39k
parameters, hidden size 32) with labels (-1, 0, 1), "1" (index 2) meaning a correct step, and a
BERT tokenizer whose pair encoding is "[CLS] previous step [SEP] step [SEP]". Its word vocabulary
is the knights-and-knaves text (pspo/tasks/knights.py: the names, the island, the question, the sayings)
plus digits, punctuation and the tag words; any other word is [UNK].

What it judges is the form of a step, the way a K&K answer line is written: a step is correct
("1") when it names a person and gives a role ("(2) Zoey is a knave"), neutral ("0") when it names
a person without a role ("(2) Zoey", a saying cut short) or restates the question, wrong ("-1")
when it names no one (other words, gibberish). The answer tags (<think>, <answer>, ...) may stand
on any kind of step and tell nothing. In a pair the label is the second step's. Like the released
PRM it never sees the puzzle, so it cannot tell a true statement from a false one. On the K&K task
with `prm.split: lines`, an answer's lines are its steps: a completion that writes every person's
role gets n = people steps scored near 1, a malformed one fewer steps or lower scores
(configs/knights/pspo_star.yaml).

The build: a vocabulary, seeded initial weights and 200 AdamW steps (batches of 64, learning rate
decaying linearly to 0) on synthetic steps and pairs of the three kinds; 5.3-5.5 s on one thread of
a 2-core CPU at load average 7 (4-13 s at other loads), then cached under $PSPO_CACHE (default
~/.cache/pspo) in a folder named by a hash of its build parameters and loaded through
`from_pretrained` like any PRM. Its
accuracy on fresh synthetic inputs is recorded in the folder's pspo_build.json (0.99).
"""
from __future__ import annotations

import random
import re
import string
import time

import torch
from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

from pspo.tasks.knights import ISLAND, KNIGHTS_INSTRUCTION, NAMES, QUESTION, SAYINGS
from pspo.offline.tiny import build_once, cache_folder, save_model_folder

VERSION = 1                   # part of the cache key: bump it whenever the build below changes
HIDDEN, LAYERS, HEADS = 32, 2, 2   # BERT width, depth, attention heads
FIT_STEPS = 200               # AdamW steps
BATCH = 64                    # synthetic inputs per step
LR = 5e-3
EXAMPLES = 3000               # synthetic training inputs, drawn once
HELD_OUT = 1000               # fresh inputs for the accuracy recorded at build time
MAX_TOKENS = 64               # the synthetic inputs are at most ~30 tokens
SINGLE_SHARE = 0.3            # share of inputs that are a first step alone (no previous step)
LABELS = ("-1", "0", "1")     # the released PRM's label list: wrong, neutral, correct
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
ROLES = ("knight", "knave")
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
EXTRA_WORDS = ("0 1 2 3 4 5 6 7 8 9 ( ) [ ] < > / \" ' . , : ; ? ! = + - * think answer not and or if then "
               "only iff is a knight knave knights knaves says claims true false liar truth step so")
WORD = re.compile(r"\w+|[^\w\s]")


def prm_vocabulary() -> list[str]:
    """The special tokens, then every lower-cased word and punctuation mark of the K&K text."""
    text = " ".join([ISLAND, QUESTION, KNIGHTS_INSTRUCTION, *SAYINGS, " ".join(NAMES), EXTRA_WORDS])
    return SPECIAL + sorted({w.lower() for w in WORD.findall(text)})


def build_prm_tokenizer() -> BertTokenizerFast:
    """A BERT word-piece tokenizer over `prm_vocabulary` (whole words only: anything else is [UNK])."""
    vocab = {word: i for i, word in enumerate(prm_vocabulary())}
    tokenizer = BertTokenizerFast(vocab=vocab, do_lower_case=True, model_max_length=512)
    tokenizer.add_tokens(TAGS)                    # one token each, as the policy's tokenizers have them
    return tokenizer


class _Steps:
    """Seeded synthetic steps of the three kinds (module docstring)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        lowered = {name.lower() for name in NAMES} | {"knight", "knave", "knights", "knaves"}
        self.filler = [w for w in prm_vocabulary()[len(SPECIAL):] if w not in lowered]

    def correct(self, k: int) -> str:
        r = self.rng
        return f"({k}) {r.choice(NAMES)} is a {r.choice(ROLES)}"

    def neutral(self, k: int) -> str:
        r = self.rng
        return r.choice([f"({k}) {r.choice(NAMES)}", f"{r.choice(NAMES)} is a", QUESTION,
                         f"{r.choice(NAMES)} " + " ".join(r.choices(self.filler, k=r.randint(1, 6)))])

    def wrong(self, k: int) -> str:
        r = self.rng
        if r.random() < 0.5:
            return " ".join(r.choices(self.filler, k=r.randint(1, 10)))
        return "".join(r.choices(string.ascii_letters + string.punctuation + " ", k=r.randint(3, 30)))

    def example(self) -> tuple[str, str | None, int]:
        """(first text, second text or None, label index of the last step)."""
        kinds = (self.wrong, self.neutral, self.correct)
        label, k = self.rng.randrange(3), self.rng.randint(2, 8)
        step = self.tagged(kinds[label](k))
        if self.rng.random() < SINGLE_SHARE:
            return step, None, label
        return self.tagged(kinds[self.rng.randrange(3)](k - 1)), step, label

    def tagged(self, step: str) -> str:
        """The step with the answer tags a K&K line may carry, on any kind alike (they tell nothing)."""
        r = self.rng
        return r.choice(["", "", "<answer>", "<think></think><answer>"]) + step + r.choice(["", "</answer>"])


def _encode(tokenizer: BertTokenizerFast, rows: list[tuple[str, str | None, int]]) -> dict[str, torch.Tensor]:
    encoded = [tokenizer(a, b, truncation=True, max_length=MAX_TOKENS) for a, b, _ in rows]
    return dict(tokenizer.pad(encoded, return_tensors="pt"))                         # (E, T) each


def _build_model(tokenizer: BertTokenizerFast, seed: int) -> BertForSequenceClassification:
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS, intermediate_size=2 * HIDDEN, max_position_embeddings=512,
                        num_labels=len(LABELS),
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
                        id2label=dict(enumerate(LABELS)), label2id={name: i for i, name in enumerate(LABELS)})
    with torch.random.fork_rng(devices=[]):    # seeded init without touching the caller's RNG
        torch.manual_seed(seed)
        return BertForSequenceClassification(config)


def _fit(model: BertForSequenceClassification, tokenizer: BertTokenizerFast, steps: _Steps,
         seed: int) -> float:
    """FIT_STEPS of AdamW on the cross-entropy of the synthetic labels; returns the held-out accuracy."""
    rows = [steps.example() for _ in range(EXAMPLES)]
    inputs, labels = _encode(tokenizer, rows), torch.tensor([label for *_, label in rows])   # (E, T), (E,)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / FIT_STEPS)   # to 0
    model.train()
    for _ in range(FIT_STEPS):
        batch = torch.randint(len(rows), (BATCH,), generator=generator)              # (BATCH,)
        width = int(inputs["attention_mask"][batch].sum(dim=1).max())      # drop all-padding columns
        loss = model(**{k: v[batch, :width] for k, v in inputs.items()}, labels=labels[batch]).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    held_out = [steps.example() for _ in range(HELD_OUT)]
    with torch.no_grad():
        predicted = model(**_encode(tokenizer, held_out)).logits.argmax(dim=-1)     # (HELD_OUT,)
    return float((predicted == torch.tensor([label for *_, label in held_out])).float().mean())


def tiny_prm_path(cache_dir: str | None = None, seed: int = 0) -> str:
    """Where the tiny PRM with these build parameters lives (built or not), as tiny.tiny_model_path."""
    return cache_folder("tiny-prm", {"version": VERSION, "seed": seed}, cache_dir)


def ensure_tiny_prm(cache_dir: str | None = None, seed: int = 0, log=print) -> str:
    """Build the tiny PRM once and return its folder; later calls return the cached folder (a call
    while another process builds it waits for that build: tiny.build_once)."""
    path = tiny_prm_path(cache_dir, seed)
    return build_once(path, lambda: _build(path, seed, log), log)


def _build(path: str, seed: int, log) -> str:
    start = time.perf_counter()
    tokenizer = build_prm_tokenizer()
    model = _build_model(tokenizer, seed)
    accuracy = _fit(model, tokenizer, _Steps(seed), seed)
    info = {"version": VERSION, "seed": seed, "fit_steps": FIT_STEPS, "batch": BATCH, "lr": LR,
            "parameters": sum(p.numel() for p in model.parameters()), "held_out_accuracy": round(accuracy, 3),
            "build_seconds": round(time.perf_counter() - start, 1)}
    log(f"built the tiny PRM in {path} in {info['build_seconds']} s: held-out accuracy {accuracy:.3f}")
    return save_model_folder(path, model, tokenizer, info_name="pspo_build.json", info=info, log=log)
