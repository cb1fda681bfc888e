"""Speculative decoding, the mechanism (issue "Speculative decoding"): random weights make a real
proposer's acceptance rate meaningless, so the proposals here replay the target's own greedy
continuation (from a run without speculation) with each proposed token corrupted with probability
`c`. Per batch size and k it times greedy generation with and without speculation, in one process
on one engine (speculation toggled between runs: the proposer, and launching steps ahead, which
speculation turns off), and reports tokens/s, the speed-up, the measured acceptance rate and
whether the outputs equal the run without speculation.

  python scripts/bench_spec_decode.py --model M --batch-sizes 1,8,32 --ks 2,4,6 \
      --corruption 1,0.5,0.25,0.1,0 --json spec.json --plot spec.png
  CPU (tiny model, a smoke run):
    python scripts/bench_spec_decode.py --model tiny-qwen3 --device cpu --batch-sizes 1 --ks 2 \
      --corruption 0 --new-tokens 16

`--ngram-copy`: also the n-gram proposer on a copy-heavy prompt: the model's own greedy passage
(from a short prompt), then the prompt and the passage's first tokens again, so that a model that
continues the passage repeats what it wrote; it reports the acceptance rate that reaches.

`--draft-model DIR`: instead of replayed proposals, a draft checkpoint (same vocabulary) proposes
k tokens per step: tokens/s with and without the pause, against no speculation, and its acceptance
(random weights: the draft and the target agree only by chance; this measures what a draft step
costs).

Corruption `1` is the overhead case: every proposal is wrong, each step computes k + 1 tokens and
emits one.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from paged_llm.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.models.builtin import resolve_model_dir
from paged_llm.sampling_params import SamplingParams
from paged_llm.sequence import Sequence
from paged_llm.spec_decode.proposer import NgramProposer
from paged_llm.spec_decode.speculator import Speculator


@dataclass
class SpecResult:
    proposer: str  # none | replay | draft_model
    batch_size: int
    k: int  # proposals per step (0: speculation off)
    corruption: float  # probability that a proposed token is replaced by a wrong one
    pause_below: float  # speculative_pause_below (0: proposals every step, the raw mechanism)
    seconds: float
    tokens_per_s: float
    speedup: float  # against speculation off, same batch size
    acceptance_rate: float  # accepted / proposed (counters)
    mean_accepted_per_step: float  # 1 + accepted / verifying sequence-steps
    outputs_equal: bool  # the tokens equal the run without speculation


class ReplayProposer:
    """Proposes the next k tokens of a known continuation, each wrong with probability `c`."""

    def __init__(self, continuations: dict[str, list[int]], k: int, corruption: float, vocab: int) -> None:
        self.continuations = continuations
        self.k = k
        self.corruption = corruption
        self.vocab = vocab
        self.rng = random.Random(0)

    def propose(self, seqs: Iterable[Sequence], num_speculative_tokens: int) -> None:
        for seq in seqs:
            known = self.continuations[seq.seq_id]
            position = seq.num_output_tokens
            drafts = list(known[position : position + min(self.k, num_speculative_tokens)])
            for index, token in enumerate(drafts):
                if self.rng.random() < self.corruption:
                    drafts[index] = (token + 1) % self.vocab
            seq.spec_token_ids = drafts


def make_prompts(batch_size: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch_size)]


def generate(
    engine: LLMEngine,
    prompts: list[list[int]],
    new_tokens: int,
    tag: str,
    replay: dict[str, list[int]] | None = None,
) -> tuple[float, dict[str, list[int]]]:
    """Greedy generation of all prompts at once; (seconds, request id -> tokens). `replay`: the
    ReplayProposer's continuations, keyed here by the ids the engine core knows the requests by."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    device = engine.core.device.torch_device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", prompt, params)
        outputs[f"{tag}-{index}"] = []
        if replay is not None:
            core_id = engine.processor.core_request_id(f"{tag}-{index}")
            assert core_id is not None
            replay[core_id] = replay.pop(f"{tag}-{index}")
    while engine.has_unfinished_requests():
        for output in engine.step():
            for delta in output.sequences:
                outputs[output.request_id].extend(delta.token_ids)
    return time.perf_counter() - start, outputs


def set_speculation(engine: LLMEngine, proposer: object | None, pause_below: float = 0.0) -> None:
    """Speculation on (a proposer) or off (None), as the engine would run with that config.
    `pause_below` 0: never pause proposing (the mechanism's own cost when nothing is accepted)."""
    core = engine.core
    k = engine.config.speculative.num_speculative_tokens
    core.speculator = None if proposer is None else Speculator(proposer, k, pause_below)


def counters(engine: LLMEngine) -> tuple[int, int, int]:
    stats = engine.core.scheduler
    return stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens


def generate_counted(
    engine: LLMEngine,
    prompts: list[list[int]],
    new_tokens: int,
    tag: str,
    replay: dict[str, list[int]] | None = None,
) -> tuple[float, dict[str, list[int]], float, float]:
    """`generate`, plus the run's acceptance rate (accepted / proposed tokens) and mean tokens per
    verifying sequence-step (1 + accepted / drafts), from the scheduler's counters."""
    before = counters(engine)
    seconds, outputs = generate(engine, prompts, new_tokens, tag, replay)
    drafts, draft_tokens, accepted = (after - b for after, b in zip(counters(engine), before))
    rate = accepted / draft_tokens if draft_tokens else 0.0
    mean_accepted = 1 + accepted / drafts if drafts else 1.0
    return seconds, outputs, rate, mean_accepted


def plain_baseline(
    engine: LLMEngine, prompts: list[list[int]], new_tokens: int, tag: str
) -> tuple[dict[str, list[int]], SpecResult]:
    """No speculation: a warm-up, the reference run (request ids `{tag}ref-i`), then the timed run,
    which must give the same tokens."""
    set_speculation(engine, None)
    generate(engine, prompts, 8, f"{tag}warm")
    _, reference = generate(engine, prompts, new_tokens, f"{tag}ref")
    seconds, plain = generate(engine, prompts, new_tokens, f"{tag}plain")
    assert all(plain[f"{tag}plain-{i}"] == reference[f"{tag}ref-{i}"] for i in range(len(prompts)))
    tokens_per_s = len(prompts) * new_tokens / seconds
    return reference, SpecResult(
        "none", len(prompts), 0, 0.0, 0.0, seconds, tokens_per_s, 1.0, 0.0, 1.0, True
    )


def run_point(
    engine: LLMEngine,
    prompts: list[list[int]],
    reference: dict[str, list[int]],
    new_tokens: int,
    k: int,
    corruption: float,
    tag: str,
    pause_below: float = 0.0,
) -> tuple[float, float, float, bool]:
    """(seconds, acceptance rate, mean accepted per step, outputs equal) of one speculative run."""
    continuations = {f"{tag}-{i}": reference[f"ref-{i}"] for i in range(len(prompts))}
    vocab = engine.info.vocab_size
    set_speculation(engine, ReplayProposer(continuations, k, corruption, vocab), pause_below)
    seconds, outputs, rate, mean_accepted = generate_counted(engine, prompts, new_tokens, tag, continuations)
    equal = all(outputs[f"{tag}-{i}"] == reference[f"ref-{i}"] for i in range(len(prompts)))
    return seconds, rate, mean_accepted, equal


def self_consistent_reference(
    engine: LLMEngine,
    prompts: list[list[int]],
    reference: dict[str, list[int]],
    new_tokens: int,
    k: int,
    max_rounds: int,
    tag: str,
) -> tuple[dict[str, list[int]], int]:
    """The greedy continuation that speculative steps themselves produce (a fixed point): replay the
    reference with nothing corrupted, take what the steps emitted as the next reference, until they
    agree. In 16-bit floats a step that scores k + 1 tokens of a sequence may round a logit
    differently from a one-token step, so a near-tie can go the other way and the continuation
    part from one-at-a-time decoding; replaying a continuation the steps do not produce would show
    rejections that are only rounding. Returns (reference, rounds); rounds = max_rounds + 1: no
    fixed point was reached."""
    for round_index in range(1, max_rounds + 1):
        continuations = {f"{tag}{round_index}-{i}": reference[f"ref-{i}"] for i in range(len(prompts))}
        proposer = ReplayProposer(continuations, k, 0.0, engine.info.vocab_size)
        set_speculation(engine, proposer)
        _, outputs = generate(engine, prompts, new_tokens, f"{tag}{round_index}", replay=continuations)
        emitted = {f"ref-{i}": outputs[f"{tag}{round_index}-{i}"] for i in range(len(prompts))}
        if emitted == reference:
            return reference, round_index
        reference = emitted
    return reference, max_rounds + 1


def draft_model_runs(
    engine: LLMEngine, batch_sizes: list[int], k: int, args: argparse.Namespace, vocab: int
) -> list[SpecResult]:
    """The engine's own draft-model proposer against no speculation, per batch size."""
    proposer = engine.core.speculator.proposer
    results = []
    for batch_size in tqdm(batch_sizes, desc="draft model"):
        prompts = make_prompts(batch_size, args.prompt_len, vocab, args.seed + batch_size)
        reference, plain = plain_baseline(engine, prompts, args.new_tokens, "d")
        results.append(plain)
        for pause_below in (0.0, args.pause_below):
            set_speculation(engine, proposer, pause_below)
            generate(engine, prompts, 8, f"dw{pause_below}")
            seconds, outputs, rate, mean_accepted = generate_counted(
                engine, prompts, args.new_tokens, f"d{pause_below}"
            )
            equal = all(outputs[f"d{pause_below}-{i}"] == reference[f"dref-{i}"] for i in range(batch_size))
            results.append(
                SpecResult(
                    "draft_model",
                    batch_size,
                    k,
                    float("nan"),
                    pause_below,
                    seconds,
                    len(prompts) * args.new_tokens / seconds,
                    plain.seconds / seconds,
                    rate,
                    mean_accepted,
                    equal,
                )
            )
    return results


def ngram_copy(engine: LLMEngine, prompt_len: int, passage_len: int, k: int, seed: int) -> dict:
    """The n-gram proposer where copying pays: prompt + the model's own passage + prompt + the
    passage's first 8 tokens; greedy continuation for `passage_len` tokens."""
    vocab = min(engine.info.vocab_size, len(engine.tokenizer))
    prompt = make_prompts(1, prompt_len, vocab, seed + 99)[0]
    set_speculation(engine, None)
    _, passage = generate(engine, [prompt], passage_len, "copy-src")
    copy_prompt = prompt + passage["copy-src-0"] + prompt + passage["copy-src-0"][:8]
    _, plain = generate(engine, [copy_prompt], passage_len, "copy-plain")
    plain_seconds, _ = generate(engine, [copy_prompt], passage_len, "copy-plain2")
    set_speculation(engine, NgramProposer(4, 1), pause_below=0.5)
    seconds, spec, rate, mean_accepted = generate_counted(engine, [copy_prompt], passage_len, "copy-spec")
    copied = sum(a == b for a, b in zip(plain["copy-plain-0"], passage["copy-src-0"][8:]))
    return {
        "k": k,
        "passage_tokens": passage_len,
        "continuation_equal_to_passage_tokens": copied,
        "acceptance_rate": rate,
        "mean_accepted_per_step": mean_accepted,
        "seconds_plain": plain_seconds,
        "seconds_ngram": seconds,
        "speedup": plain_seconds / seconds,
        "outputs_equal": spec["copy-spec-0"] == plain["copy-plain-0"],
    }


def plot(results: list[SpecResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch_sizes = sorted({r.batch_size for r in results})
    figure, axes = plt.subplots(1, len(batch_sizes), figsize=(5 * len(batch_sizes), 4), squeeze=False)
    for axis, batch_size in zip(axes[0], batch_sizes):
        for k in sorted({r.k for r in results if r.k > 0}):
            points = sorted(
                (r.acceptance_rate, r.speedup)
                for r in results
                if r.batch_size == batch_size and r.k == k and r.pause_below == 0.0 and r.proposer == "replay"
            )
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"k = {k}")
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_title(f"batch {batch_size}")
        axis.set_xlabel("acceptance rate (accepted / proposed)")
        axis.set_ylabel("speed-up over no speculation")
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--ks", default="2,4,6")
    parser.add_argument("--corruption", default="1,0.5,0.25,0.1,0")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--ngram-copy", action="store_true")
    parser.add_argument(
        "--paused-corruption",
        default="1",
        help="corruption levels also run with proposing paused while it does not pay (--pause-below)",
    )
    parser.add_argument("--pause-below", type=float, default=0.5)
    parser.add_argument("--draft-model", default=None, help="a draft checkpoint: time its proposals")
    parser.add_argument(
        "--max-rounds", type=int, default=6, help="replay rounds to find the self-consistent reference"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    corruptions = [float(c) for c in args.corruption.split(",")]

    model_dir = resolve_model_dir(args.model)
    speculative = SpeculativeConfig(num_speculative_tokens=max(ks))
    if args.draft_model:
        speculative = SpeculativeConfig(
            num_speculative_tokens=max(ks),
            speculative_method="draft_model",
            speculative_model=args.draft_model,
        )
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype=args.dtype, max_model_len=args.max_model_len),
        cache=CacheConfig(),
        scheduler=SchedulerConfig(max_num_seqs=max(batch_sizes), max_num_batched_tokens=8192),
        device=DeviceConfig(device=args.device),
        speculative=speculative,
    )
    engine = LLMEngine(config, show_progress=False)
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    vocab = min(engine.info.vocab_size, len(engine.tokenizer))
    if args.draft_model:
        results = draft_model_runs(engine, batch_sizes, max(ks), args, vocab)
        print(f"\ncard: {card}; model {model_dir.name}, draft {Path(args.draft_model).name} "
              f"({engine.info.dtype}); k = {max(ks)}")  # fmt: skip
        for r in results:
            print(
                f"batch {r.batch_size:>3} {r.proposer:>12} pause {r.pause_below:.2f}: "
                f"{r.tokens_per_s:>8.0f} tok/s {r.speedup:.2f}x, accepted {r.acceptance_rate:.1%}, "
                f"equal {r.outputs_equal}"
            )
        if args.json:
            payload = {"card": card, "model": model_dir.name, "draft_model": args.draft_model}
            payload["results"] = [asdict(r) for r in results]
            args.json.write_text(json.dumps(payload, indent=2, default=str))
        return
    results: list[SpecResult] = []
    rounds: dict[tuple[int, int], int] = {}  # (batch, k) -> rounds to the self-consistent reference
    paused = [float(c) for c in args.paused_corruption.split(",") if c]
    points = [(k, c, 0.0) for k in ks for c in corruptions] + [
        (k, c, args.pause_below) for k in ks for c in paused
    ]
    progress = tqdm(total=len(batch_sizes) * (len(points) + 2), desc="runs")
    for batch_size in batch_sizes:
        prompts = make_prompts(batch_size, args.prompt_len, vocab, args.seed + batch_size)
        reference, plain = plain_baseline(engine, prompts, args.new_tokens, "")
        progress.update(2)
        results.append(plain)
        # A speculative warm-up (Triton kernels and the verification's first calls compile here).
        run_point(engine, prompts, reference, 8, max(ks), 0.0, f"w{batch_size}")
        replayed: dict[int, tuple[dict[str, list[int]], int]] = {}
        for run, (k, corruption, pause_below) in enumerate(points):
            if k not in replayed:
                replayed[k] = self_consistent_reference(
                    engine, prompts, reference, args.new_tokens, k, args.max_rounds, f"fp{batch_size}-{k}-"
                )
                rounds[(batch_size, k)] = replayed[k][1]
            seconds, rate, mean_accepted, equal = run_point(
                engine,
                prompts,
                replayed[k][0],
                args.new_tokens,
                k,
                corruption,
                f"s{batch_size}-{run}",
                pause_below,
            )
            equal = equal and replayed[k][0] == reference
            results.append(
                SpecResult(
                    "replay",
                    batch_size,
                    k,
                    corruption,
                    pause_below,
                    seconds,
                    batch_size * args.new_tokens / seconds,
                    plain.seconds / seconds,
                    rate,
                    mean_accepted,
                    equal,
                )
            )
            progress.update(1)
    progress.close()
    copy = None
    if args.ngram_copy:
        copy = ngram_copy(engine, args.prompt_len, args.new_tokens, max(ks), args.seed)

    print(f"\ncard: {card}; model {model_dir.name} ({engine.info.dtype}); prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, greedy")  # fmt: skip
    print(f"{'batch':>6}{'k':>4}{'corrupt':>9}{'pause':>7}{'tok/s':>10}{'speed-up':>10}{'accept':>9}"
          f"{'per step':>10}{'equal':>7}")  # fmt: skip
    for r in results:
        print(
            f"{r.batch_size:>6}{r.k:>4}{r.corruption:>9.2f}{r.pause_below:>7.2f}{r.tokens_per_s:>10.0f}{r.speedup:>10.2f}"
            f"{r.acceptance_rate:>9.1%}{r.mean_accepted_per_step:>10.2f}{r.outputs_equal!s:>7}"
        )
    print("rounds to the self-consistent reference (batch, k): " + ", ".join(
        f"({b}, {k}): {r if r <= args.max_rounds else 'none'}" for (b, k), r in rounds.items()))  # fmt: skip
    if copy is not None:
        print(f"n-gram on a copy-heavy prompt: {json.dumps(copy)}")
    if args.plot:
        plot(results, args.plot, f"{model_dir.name} on {card}: replayed proposals")
    if args.json:
        payload = {"card": card, "model": model_dir.name, "dtype": engine.info.dtype, "args": vars(args)}
        payload["results"] = [asdict(r) for r in results]
        payload["ngram_copy"] = copy
        payload["reference_rounds"] = {f"{b},{k}": r for (b, k), r in rounds.items()}
        args.json.write_text(json.dumps(payload, indent=2, default=str))


if __name__ == "__main__":
    main()
