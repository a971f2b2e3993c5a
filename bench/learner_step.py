"""The learner's whole step (forward, loss, backward, optimizer) per logprob kernel backend, on a
randomly initialised Qwen2 of a real model's shape: seconds per step, trained tokens/s and peak
memory, so a kernel's gain can be read where it matters, inside the step.

    python bench/learner_step.py --shape qwen2-0.5b --mixed-precision bf16       (a GPU)
    python bench/learner_step.py --shape small --groups 4 --completion-tokens 32 (a CPU smoke run)
    python bench/learner_step.py --shape qwen2-0.5b --backends torch --samplers none,p0.9,k50 \
        --groups 1 --n 4 --completion-tokens 96 --mixed-precision no      (the top-k / top-p cut's cost)

Prints one JSON line per backend and sampler (the median of --steps steps after one warm-up), then one
line of ratios against the first. A sampler is `none` (the whole vocabulary) or a top-k / top-p cut the
learner scores as the actors sample (`p0.9`, `k50`, `k50p0.95`); --logit-scale spreads the random model's
logits (its untrained ones are near uniform, so a nucleus holds most of the vocabulary: the cut's worst
case). Mixed precision bf16 keeps fp32 master weights and an fp32 LM head, as a run with
`learner.mixed_precision: bf16` does.
"""

import argparse
import json
import statistics
import time
from dataclasses import replace

import numpy as np
import torch

# (hidden, layers, heads, kv heads, MLP width, vocabulary)
SHAPES = {
    "qwen2-0.5b": (896, 24, 14, 2, 4864, 151936),
    "qwen2-1.5b": (1536, 28, 12, 2, 8960, 151936),
    "small": (128, 2, 4, 2, 256, 4096),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--backends", default="auto,triton,torch", help="learner.kernel_backend values")
    parser.add_argument("--mixed-precision", default="bf16", choices=["no", "bf16"])
    parser.add_argument("--groups", type=int, default=16, help="groups per step")
    parser.add_argument("--n", type=int, default=8, help="samples per group")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument(
        "--completion-tokens",
        type=int,
        default=448,
        help="the longest completion; lengths are drawn uniformly from an eighth of it up to it",
    )
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--samplers", default="none", help="none, or top-k / top-p cuts: p0.9, k50, k50p0.95")
    parser.add_argument("--logit-scale", type=float, default=1.0, help="multiply the tied LM head by this")
    return parser.parse_args(argv)


def parse_sampler(text: str):
    """`none`, `p0.9`, `k50`, `k50p0.95` -> the learner's Sampler at temperature 1."""
    import re

    from tidal.learner.every_rank.trainer import Sampler

    match = re.fullmatch(r"(?:k(\d+))?(?:p([0-9.]+))?", "" if text == "none" else text)
    if match is None:
        raise SystemExit(f"--samplers: {text!r} is not none, pP, kK or kKpP")
    return Sampler(1.0, int(match[1] or 0), float(match[2] or 1.0))


def build_model(shape: str, logit_scale: float = 1.0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv_heads, mlp, vocab = SHAPES[shape]
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(logit_scale)
    return model


def step_batch(args, vocab: int, version: int):
    """Groups of random tokens with uneven completion lengths, every token trained on."""
    from tidal.broker.schema import RolloutGroup, SampleArrays, int32s

    rng = np.random.default_rng(0)
    groups, masks = [], []
    for g in range(args.groups):
        samples = []
        for i in range(args.n):
            length = int(rng.integers(max(1, args.completion_tokens // 8), args.completion_tokens + 1))
            samples.append(
                SampleArrays.of(
                    rng.integers(0, vocab, length),
                    -2.0 + 0.3 * rng.standard_normal(length),
                    version_spans=[(version, 0, length)],
                    reward=float((g + i) % 2),
                    finish_reason="stop",
                )
            )
        groups.append(
            RolloutGroup.pack(
                samples,
                group_id=f"g{g}",
                prompt_id=g,
                actor_id="bench",
                prompt_tokens=int32s(rng.integers(0, vocab, args.prompt_tokens)),
            )
        )
        masks.append([np.ones(s.sample.num_tokens, dtype=bool) for s in samples])
    return groups, masks


def measure(args, backend: str, sampler: str, groups, masks) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from tidal.config import LearnerConfig, OptimConfig
    from tidal.learner.every_rank.trainer import Trainer

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=args.mixed_precision)
    cfg = LearnerConfig(
        groups_per_step=args.groups,
        micro_batch_tokens=args.micro_batch_tokens,
        kernel_backend=backend,
        mixed_precision=args.mixed_precision,
    )
    cfg = replace(cfg, optim=OptimConfig(lr=1e-6))
    trainer = Trainer(cfg, build_model(args.shape, args.logit_scale), accelerator, temperature=parse_sampler(sampler))
    cuda = accelerator.device.type == "cuda"
    times, loss = [], None
    for step in range(1 + args.steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        metrics = trainer.step(groups, masks, version=step)
        if cuda:
            torch.cuda.synchronize()
        if step > 0:
            times.append(time.perf_counter() - start)
        loss = metrics["learner/loss"]
    tokens = sum(s.num_tokens for g in groups for s in g.samples)
    step_s = statistics.median(times)
    result = dict(
        bench="learner_step",
        backend=backend,
        sampler=sampler,
        shape=args.shape,
        device=accelerator.device.type,
        outside_support_frac=metrics["offpolicy/outside_support_frac"],
        mixed_precision=args.mixed_precision,
        groups=args.groups,
        samples=args.groups * args.n,
        trained_tokens=tokens,
        step_s=round(step_s, 4),
        trained_tokens_per_s=round(tokens / step_s),
        peak_mem_bytes=torch.cuda.max_memory_allocated() if cuda else None,
        loss=loss,
    )
    del trainer
    if cuda:
        torch.cuda.empty_cache()
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    vocab = SHAPES[args.shape][-1]
    groups, masks = step_batch(args, vocab, version=0)
    results = []
    for backend in args.backends.split(","):
        for sampler in args.samplers.split(","):
            results.append(measure(args, backend, sampler, groups, masks))
            print(json.dumps(results[-1]), flush=True)
    first = results[0]
    print(
        json.dumps(
            {
                "ratios": f"step_s / {first['backend']} {first['sampler']}'s",
                **{f"{r['backend']} {r['sampler']}": round(r["step_s"] / first["step_s"], 3) for r in results},
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
