"""Generation speed of the rollout engines on the same prompts: tokens/s and ms per decoding step.

    python bench/rollout.py                                   # the tiny model: generate vs static loop
    python bench/rollout.py --arch configs/qwen2.5-math-1.5b/model_config.json --prompts 8 --n 6 \\
        --max-new-tokens 512 --bf16                           # the 1.5B at real widths, random weights (GPU)
    python bench/rollout.py --engines generate static vllm    # vLLM too, where it is installed
    python bench/rollout.py --random 8,512 --max-new-tokens 64     # a random-weight 8 x 512 Qwen2
    python bench/rollout.py --model M --bf16 --engines static-full static --prompts 8 --n 6 \\
        --max-new-tokens 3584 --cache-len 4096 --lengths recipe --repeats 1 --json F   # the recipe's rollout
    python bench/rollout.py --random 4,256 --engines static-full static-window static-compact static \\
        --prompts 8 --n 6 --max-new-tokens 512 --cache-len 1024 --lengths recipe   # CPU: the ratios

Engines: `generate` is HFEngine's transformers `generate` loop (dynamic KV cache, the sampler as a
logits processor); `generate-static` the same with transformers' own StaticCache (which `generate`
compiles on CUDA); `static` is its static-cache loop (pspo/engines/decode.py: length-aware windows
and row compaction), compiled as `rollout.compile` says (--compile; auto: on CUDA, CUDA graphs
there); `static-full` the same loop over the whole cache with every row to the end (what it was
before windows and compaction), `static-window` with windows only, `static-compact` with
compaction only; `vllm` is the colocated in-process engine train.py uses. Each generates n
completions of each of the same prompts (the built-in task under the chat template, or for
--arch/--random the stand-in tokenizer's), with the same seeds. Random weights never stop (every
row runs to its budget): `--lengths recipe` gives each row its own budget, log-uniform in [10,
max new tokens], the completion lengths of bench/micro_batches.py's update batch (48 rows of at
most 3584 tokens: 10-3523, median 327), the same in every call; the static engines alone take
per-row budgets.

Each engine makes its first call (the warm-up; with compile, the compile) and its first timed call
before the next engine starts, the further --repeats calls taking turns; --json is rewritten after
every call with what is measured so far (a run stopped during one engine keeps the engines before
it). --warmup-tokens N cuts `static-full`'s first call to N new tokens a row: a loop of one shape
(every row to the end, the whole cache) compiles and records its CUDA graph in its first steps,
while the length-aware loops meet their shapes (windows, row buckets) only along the whole length.
Columns: the first call, then the median over --repeats calls: completion tokens per second
(tokens up to and including the stop token, or up to the row's budget), ms per decoding step (call
time / columns generated, the prefill included), the cache positions a static loop's step attends
over (rows x window, averaged over its steps), the rows whose tokens equal the first engine's, and on CUDA the peak
memory allocated (on CPU the process's CPU seconds per call instead: steadier than wall time when
other work shares the cores). With `static-full` and another static loop, a second table gives
their ratios to `static-full`: length-aware vs whole-cache decoding, shrinking vs fixed rows. Run
it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pspo.tasks.data import builtin_arithmetic, format_prompt  # noqa: E402
from pspo.training.model import build_policy, load_tokenizer  # noqa: E402
from pspo.engines.decode import row_ends  # noqa: E402
from pspo.engines.hf_engine import HFEngine  # noqa: E402
from pspo.rollout import compile_enabled  # noqa: E402
from pspo.engines.sampling import column_keys, draw  # noqa: E402
from pspo.training.tokens import left_pad  # noqa: E402
from bench.child_process import write_figures  # noqa: E402
from bench.micro_batches import skewed_batch  # noqa: E402
from pspo.engines.sampling import sequence_seeds  # noqa: E402
from pspo.offline.standin import build_random_model  # noqa: E402
from pspo.offline.tiny import ensure_tiny_model  # noqa: E402

STATIC = {"static": (True, True), "static-full": (False, False), "static-window": (True, False),
          "static-compact": (False, True)}        # the static loop's (window, compact)
ENGINES = ("generate", "generate-static", *STATIC, "vllm")
RECIPE_PROMPT = 512                               # the 1.5B recipe's data.max_prompt_tokens


def random_model(size: str) -> str:
    """Save a random Qwen2 (LAYERS,HIDDEN) with the tiny model's tokenizer to a temporary folder."""
    layers, hidden = (int(x) for x in size.split(","))
    tokenizer = load_tokenizer(ensure_tiny_model(), False)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(1, hidden // 256), max_position_embeddings=4096,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="pspo-bench-model-")
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build(name: str, path: str, tokenizer, policy, args, max_len: int, device: str):
    if name == "generate-static" and getattr(policy, "bf16", False):
        # transformers' StaticCache holds one dtype, but under autocast the keys leave the rotary
        # embedding in float32 and the values in bf16: give it a bf16 copy of the model instead
        policy = copy.deepcopy(policy).to(torch.bfloat16)
        policy.bf16 = False
    if name in ("generate", "generate-static"):
        return HFEngine(policy, tokenizer, batch_size=args.prompts * args.n, max_len=max_len, loop=name)
    if name in STATIC:
        engine = HFEngine(policy, tokenizer, batch_size=args.prompts * args.n, max_len=max_len,
                          compile=compile_enabled(args.compile, torch.device(device)))
        engine.decoder.window, engine.decoder.compact = STATIC[name]
        engine.decoder.pad_shapes = True             # a compiled run's shapes (--cache-len's cache) on CPU too
        engine.reads = CacheReads(engine.decoder)
        return engine
    from pspo.engines.vllm_engine import VLLMEngine
    return VLLMEngine(path, tokenizer, max_model_len=max_len, seed=0, bf16=args.bf16)


class CacheReads:
    """Counts a static loop's decoding steps and the cache positions they attend over (rows x window),
    by wrapping its step function (compiled or not)."""

    def __init__(self, decoder):
        self.steps = self.positions = 0
        step = decoder.step

        def counted(tokens, positions, key_valid, kv):
            self.steps += 1
            self.positions += key_valid.shape[0] * key_valid.shape[1]            # (R, W)
            return step(tokens, positions, key_valid, kv)
        decoder.step = counted

    def take(self) -> tuple[int, int]:
        """(steps, positions) since the last take."""
        counts = (self.steps, self.positions)
        self.steps = self.positions = 0
        return counts


def row_budgets(spec: str, rows: int, max_new_tokens: int) -> torch.Tensor | None:
    """--lengths: None for `max`; for `recipe`, (rows,) budgets log-uniform in [10, max_new_tokens]: the
    completion lengths of bench/micro_batches.py's update batch (48 rows, 3584: 10-3523, median 327)."""
    if spec == "max":
        return None
    return skewed_batch(rows, 2, max_completion=max_new_tokens, max_prompt=RECIPE_PROMPT)[4]


def lengths_error(spec: str, engines: list[str], max_new_tokens: list[int]) -> str | None:
    """What is wrong with --lengths for these engines and budgets, or None."""
    if spec == "recipe" and min(max_new_tokens) < 10:
        return (f"--lengths recipe: budgets start at 10 new tokens, --max-new-tokens {min(max_new_tokens)} "
                "is under")
    others = [e for e in engines if e not in STATIC]
    if spec != "max" and others:
        return (f"--lengths {spec}: only the static engines ({', '.join(STATIC)}) take per-row budgets, "
                f"not {', '.join(others)}")
    return None


def timed(engine, prompts, n: int, max_new_tokens: int, step: int, budgets: torch.Tensor | None):
    """(wall seconds, CPU seconds of this process, completion ids (N, T), mask (N, T) bool) of one call
    with the seeds of `step`; with budgets (N,), each row ends at its stop token or its own budget
    (the static loop called directly: the engine contract has no per-row budgets)."""
    seeds = sequence_seeds(0, step, torch.arange(len(prompts)), n)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    if budgets is None:
        out = engine.generate(prompts, n, 1.0, 1.0, max_new_tokens, seeds)
        ids, mask = out.completion_ids, out.mask.bool()
    else:
        decoder = engine.decoder
        input_ids, attention = (x.repeat_interleave(n, 0).to(decoder.device)
                                for x in left_pad(prompts, engine.pad_id))      # (N, P) each
        budgets, seeds = budgets.to(decoder.device), seeds.to(decoder.device)
        ids, _ = decoder.generate(input_ids, attention, seeds, 1.0, 1.0, max_new_tokens, budgets)   # (N, T)
        ends = row_ends(ids, decoder.stop_ids, budgets)                         # (N,)
        mask = torch.arange(ids.shape[1], device=ids.device) < ends[:, None]
        ids, mask = ids.cpu(), mask.cpu()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu, ids, mask


def check_compiled_sampler(rows: int, vocab: int) -> str:
    """The compiled sampler (inductor: Triton on CUDA) against the eager one on random logits."""
    logits = torch.randn(rows, vocab, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    seeds = sequence_seeds(0, 0, torch.arange(rows), 1).cuda()
    compiled = torch.compile(draw, dynamic=False)
    columns = column_keys(vocab, "cuda")
    same, worst = 0, 0.0
    for t in range(8):
        position = torch.tensor(t, device="cuda")
        a, la = compiled(logits, seeds, position, temperature=1.0, top_p=1.0, columns=columns)
        b, lb = draw(logits, seeds, position, temperature=1.0, top_p=1.0)
        same += int((a == b).sum())
        worst = max(worst, float((la - lb).abs().max()))
    return f"compiled sampler vs eager, {rows} rows x {vocab}, 8 positions: {same}/{8 * rows} draws equal, " \
           f"max |d logp| {worst:.1e}"


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="a from_pretrained folder (default: the tiny demo model)")
    ap.add_argument("--arch", default="", help="a config.json: its architecture, real widths, random weights")
    ap.add_argument("--layers", type=int, default=None, help="with --arch: keep this many decoder layers")
    ap.add_argument("--random", default="", metavar="LAYERS,HIDDEN",
                    help="a random-weight Qwen2 of this size with the tiny tokenizer (completions run long)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, nargs="+", default=[12, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", nargs="+", default=["generate", "static"], choices=ENGINES)
    ap.add_argument("--compile", default="auto", choices=("auto", "always", "never"),
                    help="the static engine's rollout.compile (auto: on CUDA)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast over float32 weights, as model.bf16")
    ap.add_argument("--cache-len", type=int, default=0,
                    help="the static caches' length (default: the longest prompt + max new tokens; a recipe's "
                         "is data.max_prompt_tokens + rollout.max_new_tokens, 4096 for the 1.5B)")
    ap.add_argument("--lengths", default="max", choices=("max", "recipe"),
                    help="each row's budget of new tokens: max (--max-new-tokens each) or recipe (log-uniform in "
                         "[10, max new tokens], the recipe's completion lengths; static engines only)")
    ap.add_argument("--json", default="", help="also write the figures to this JSON file (after each call: "
                    "what is measured so far)")
    ap.add_argument("--warmup-tokens", type=int, default=0, help="static-full's first call decodes at most this "
                    "many new tokens a row (0: its whole budgets): its one shape compiles in the first steps")
    args = ap.parse_args(argv)
    error = lengths_error(args.lengths, args.engines, args.max_new_tokens)
    if error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    if args.arch:
        path = os.path.join(tempfile.mkdtemp(prefix="pspo-bench-model-"), "model")
        build_random_model(args.arch, path, shrink=False, num_layers=args.layers, log=lambda *a: None)
    else:
        path = random_model(args.random) if args.random else (args.model or ensure_tiny_model())
    tokenizer = load_tokenizer(path, False)
    prompts = [tokenizer(format_prompt(tokenizer, ex.problem, ""), add_special_tokens=False)["input_ids"]
               for ex in builtin_arithmetic("train")[:args.prompts]]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = build_policy(path, chunk_tokens=2048, bf16=args.bf16, trainable=False).to(device)
    max_len = max(args.cache_len, max(map(len, prompts)) + max(args.max_new_tokens))
    engines = {name: build(name, path, tokenizer, policy, args, max_len, device) for name in args.engines}
    where = torch.cuda.get_device_name() if device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    name = os.path.relpath(args.arch) if args.arch else path
    compiled = compile_enabled(args.compile, torch.device(device))
    precision = "bf16 autocast" if args.bf16 else "float32"
    rows, reference = args.prompts * args.n, args.engines[0]
    print(f"{name}: {args.prompts} prompts x {args.n} completions, {where}, {precision}, "
          f"static compile: {compiled}, lengths: {args.lengths}, median of {args.repeats} calls")
    if device == "cuda" and compiled and any(e in STATIC for e in engines):
        print(check_compiled_sampler(rows, policy.lm.config.vocab_size))
    figures: dict = {"device": where, "model": name, "precision": precision, "rows": rows, "cache_len": max_len,
                     "compiled": compiled, "lengths": args.lengths, "reference": reference, "runs": []}
    for max_new in args.max_new_tokens:
        budgets = row_budgets(args.lengths, rows, max_new)
        if budgets is not None:
            print(f"\nbudgets: {int(budgets.min())}-{int(budgets.max())} new tokens, median "
                  f"{int(budgets.median())}, mean {float(budgets.float().mean()):.0f}")
        print("\n| engine | max new tokens | first call s | mean length | tok/s | ms / step | cache positions / "
              f"step | rows equal to {reference} | " + ("peak GiB |" if device == "cuda" else "CPU s / call |")
              + " compiles / recompiles / CUDA-graph skips |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        first, times, cpu, outs, peaks = {}, {k: [] for k in engines}, {k: [] for k in engines}, {}, {}
        reads = {name: [0, 0] for name in engines if name in STATIC}     # timed calls' (steps, positions)
        graphs: dict[str, dict[str, int]] = {}
        earlier = list(figures["runs"])                               # the figures of earlier budgets

        def run(name: str) -> dict:
            """An engine's figures so far: its first call, and its timed calls' once one has run."""
            r = {"engine": name, "max_new_tokens": max_new, "first_call_s": first[name],
                 "first_call_max_new_tokens": warm_new(name), "peak_gib": peaks[name] if device == "cuda" else None,
                 **graphs[name]}
            if name not in outs:
                return r
            (ids, mask), seconds = outs[name], statistics.median(times[name])
            ref_ids, ref_mask = outs[reference]
            steps, positions = reads.get(name, (0, 0))
            return dict(r, tokens_per_s=float(mask.sum() / seconds), ms_per_step=1000 * seconds / ids.shape[1],
                        steps=ids.shape[1], mean_length=float(mask.sum(1).float().mean()), wall_s=seconds,
                        cpu_s=statistics.median(cpu[name]),
                        cache_positions_per_step=positions / steps if name in reads else None,
                        rows_equal=sum(a[m].tolist() == b[mb].tolist()
                                       for a, m, b, mb in zip(ids, mask, ref_ids, ref_mask)))

        def warm_new(name: str) -> int:
            """The new tokens of an engine's first call: --warmup-tokens for static-full, else max_new."""
            return min(max_new, args.warmup_tokens) if name == "static-full" and args.warmup_tokens else max_new

        def measured(name: str) -> None:
            """Write what is measured so far (--json): a section stopped later keeps it."""
            if args.json:
                figures["runs"] = earlier + [run(n) for n in engines if n in first]
                write_figures(args.json, figures)

        # engine by engine, its first call (the warm-up: its compiles) and its first timed call, its figures
        # written after each; further timed calls take turns
        for step in range(1, args.repeats + 1):
            for name, engine in engines.items():
                if step == 1:
                    if device == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    before = compile_counts()
                    warm = warm_new(name)
                    first[name] = timed(engine, prompts, args.n, warm, 0,
                                        None if budgets is None else budgets.clamp(max=warm))[0]
                    graphs[name] = {"compiles": compile_counts()["graphs"] - before["graphs"],
                                    "skips": compile_counts()["skips"] - before["skips"], "recompiles": 0}
                    peaks[name] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
                    if name in STATIC:
                        engine.reads.take()                           # the timed calls' reads only
                    measured(name)
                before = compile_counts()
                seconds, cpu_seconds, *outs[name] = timed(engine, prompts, args.n, max_new, step, budgets)
                graphs[name]["recompiles"] += compile_counts()["graphs"] - before["graphs"]
                graphs[name]["skips"] += compile_counts()["skips"] - before["skips"]
                times[name].append(seconds)
                cpu[name].append(cpu_seconds)
                if name in STATIC:
                    reads[name] = [a + b for a, b in zip(reads[name], engine.reads.take())]
                measured(name)
        figures["runs"] = earlier + [run(name) for name in engines]
        for r in figures["runs"][len(earlier):]:
            name = r["engine"]
            print(f"| {name} | {max_new} | {r['first_call_s']:.2f} | {r['mean_length']:.1f} | "
                  f"{r['tokens_per_s']:,.0f} | {r['ms_per_step']:.2f} | "
                  + ("-" if r["cache_positions_per_step"] is None else f"{r['cache_positions_per_step']:,.0f}")
                  + f" | {r['rows_equal']}/{rows} | "
                  + (f"{peaks[name]:.1f} |" if device == "cuda" else f"{r['cpu_s']:.2f} |")
                  + f" {graphs[name]['compiles']} / {graphs[name]['recompiles']} / {graphs[name]['skips']} |")
        print_ratios(figures["runs"], max_new, device)
        for kind, values in (("wall", times), ("CPU", cpu)):
            static, generate = values.get("static"), values.get("generate")
            if static and generate and (kind == "wall" or device == "cpu"):
                print(f"static / generate {kind} time, max_new_tokens {max_new}: per call "
                      + ", ".join(f"{s / g:.2f}" for s, g in zip(static, generate))
                      + f"; median {statistics.median(static) / statistics.median(generate):.2f}"
                      + f", fastest {min(static) / min(generate):.2f}")
        if args.json:
            write_figures(args.json, figures)


def print_ratios(runs: list[dict], max_new: int, device: str) -> None:
    """Each static loop's time and cache reads over static-full's, from this budget's runs (with
    static-full among them): length-aware vs whole-cache decoding, shrinking vs fixed rows."""
    mine = {r["engine"]: r for r in runs if r["max_new_tokens"] == max_new}
    full = mine.get("static-full")
    others = [e for e in STATIC if e in mine and e != "static-full"]
    if full is None or not others:
        return
    print(f"\n| engine / static-full, max new tokens {max_new} | wall time | "
          + ("CPU time | " if device == "cpu" else "") + "cache positions read |")
    print("|---|---:|---:|" + ("---:|" if device == "cpu" else ""))
    for name in others:
        r = mine[name]
        r["wall_vs_full"] = r["wall_s"] / full["wall_s"]
        reads = r["cache_positions_per_step"] * r["steps"] / (full["cache_positions_per_step"] * full["steps"])
        print(f"| {name} | {r['wall_vs_full']:.2f} | " + (f"{r['cpu_s'] / full['cpu_s']:.2f} | " if device == "cpu"
              else "") + f"{reads:.2f} |")


def compile_counts() -> dict[str, int]:
    """torch.compile's running counts: graphs compiled (dynamo's unique graphs) and CUDA graphs skipped."""
    from torch._dynamo.utils import counters
    return {"graphs": counters["stats"]["unique_graphs"], "skips": counters["inductor"]["cudagraph_skips"]}


if __name__ == "__main__":
    main(sys.argv[1:])
