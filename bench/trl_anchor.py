"""The in-process anchor: TRL's GRPOTrainer on the same warm-started model, task, split, learning-rate
schedule, optimizer, batch and loss as a tidal config. Its weights are kept every `--eval-every` steps
and evaluated after training by the evaluator tidal's runs get in bench/async.py (runs.HeldOut), so
neither side's training time holds an evaluation; its history is in the shape bench/runs.py reads.

Optional: `pip install -e ".[bench]"` brings TRL. HF `generate` samples in the training process on
every core it is given; tidal's runs get the same cores, one per role.

    python bench/trl_anchor.py tiny --seed 0        # one run: its history and timings as JSON
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from runs import HeldOut


def trl_history(config: str, seed: int, overrides: list[str], every: int) -> dict:
    """history: metric -> {step: value} for eval/pass_rate, compute/wall_s and compute/samples, as a tidal
    run logs them (wall seconds from the start of training); train_end_unix: when training ended;
    in_run_eval_s: the evaluations at the start and the end (a tidal run makes those two itself);
    offline_eval_s: the others', which bench/async.py leaves out of the whole command's time."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tidal.config import load_config, preset_path
    from tidal.learner.every_rank.trainer import lr_factor
    from tidal.models import resolve_model_path
    from tidal.tasks import get_task

    cfg = load_config(preset_path(config), [*overrides, f"learner.seed={seed}"])
    path = resolve_model_path(cfg.model, cfg.task)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    held_out = HeldOut(cfg)
    split = get_task(cfg.task.name).load_prompts(cfg.task)
    keys = sorted(split.train[0].payload)
    dataset = Dataset.from_list([{"prompt": p.text, **p.payload} for p in split.train])
    history: dict[str, dict[int, float]] = {"eval/pass_rate": {}, "compute/wall_s": {}, "compute/samples": {}}
    samples_per_step = cfg.learner.groups_per_step * cfg.sampling.n
    kept: dict[int, dict] = {}

    def rewards(prompts, completions, **columns):
        return [float(held_out.reward(text, {k: columns[k][i] for k in keys})) for i, text in enumerate(completions)]

    class Keep(TrainerCallback):
        """The weights of every `every`-th step and the last, copied aside (a millisecond on the tiny models)."""

        def __init__(self):
            self.start = time.perf_counter()

        def record(self, step: int, model) -> None:
            history["compute/wall_s"][step] = time.perf_counter() - self.start
            history["compute/samples"][step] = step * samples_per_step
            if step % max(every, 1) == 0 or step == cfg.learner.max_steps:
                kept[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.start = time.perf_counter()
            self.record(0, model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.record(state.global_step, model)

    optim, loss = cfg.learner.optim, cfg.learner.loss
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            logging_steps=10**9,
            seed=seed,
            max_steps=cfg.learner.max_steps,
            per_device_train_batch_size=samples_per_step,
            num_generations=cfg.sampling.n,
            max_completion_length=cfg.sampling.max_tokens,
            temperature=cfg.sampling.temperature,
            top_p=cfg.sampling.top_p,
            max_grad_norm=optim.max_grad_norm or 1e9,
            beta=0.0,
            loss_type=loss.type.value if loss.type.value in ("cispo",) else "dapo",
            epsilon_high=loss.eps_max if loss.type.value == "cispo" else None,
            scale_rewards=cfg.learner.advantage_norm.value,
        )
        # tidal's own optimizer and lr schedule (warmup, then constant or decaying), stepped once per step
        adamw = torch.optim.AdamW(
            model.parameters(), lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(adamw, lambda s: lr_factor(cfg.learner, s))
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=rewards,
            args=args,
            train_dataset=dataset,
            processing_class=held_out.tokenizer,
            callbacks=[Keep()],
            optimizers=(adamw, schedule),
        )
        trainer.train()
    train_end = time.time()
    history["eval/pass_rate"], timed = evaluate_kept(held_out, kept)
    return {
        "history": history,
        "train_end_unix": train_end,
        "in_run_eval_s": timed[True],
        "offline_eval_s": timed[False],
        "samples_generated": samples_per_step * max(kept),
        "samples_trained": samples_per_step * max(kept),
    }


def evaluate_kept(held_out: HeldOut, kept: dict[int, dict]) -> tuple[dict[int, float], dict[bool, float]]:
    """{step: pass rate} of the weights kept at each step, and the seconds that took: True for the first
    and last step (a tidal run evaluates those itself), False for the others."""
    first, last = min(kept), max(kept)
    rates, timed = {}, {True: 0.0, False: 0.0}
    for step, state in sorted(kept.items()):
        began = time.perf_counter()
        rates[step] = held_out(state, step)
        timed[step in (first, last)] += time.perf_counter() - began
    return rates, timed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", help="preset or YAML file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=10, help="keep (and evaluate) the weights every N steps")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_intermixed_args()
    print(json.dumps(trl_history(args.config, args.seed, args.overrides, args.eval_every)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
