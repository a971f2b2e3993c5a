"""The in-process anchor: TRL's GRPOTrainer on the same warm-started model, task, split, learning-rate
schedule, optimizer, batch and loss as a tidal config, evaluated the same way (eval.n samples of every held-out
prompt at eval.temperature, every eval.every steps), its history in the shape bench/runs.py reads.

Optional: `pip install -e ".[bench]"` brings TRL. HF `generate` samples in the training process on
every core it is given; tidal's runs get the same cores, one per role.

    python bench/trl_anchor.py tiny --seed 0        # one run, its history as JSON
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time


def trl_history(config: str, seed: int, overrides: list[str]) -> dict[str, dict[int, float]]:
    """metric -> {step: value} for eval/pass_rate, compute/wall_s and compute/samples, as a tidal run
    logs them (wall seconds from the start; the step-0 evaluation ends at compute/wall_s[0])."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tidal.config import load_config, preset_path
    from tidal.learner.trainer import lr_factor
    from tidal.learner.warmstart import pass_rate
    from tidal.models import resolve_model_path
    from tidal.tasks import get_reward, get_task

    cfg = load_config(preset_path(config), [*overrides, f"learner.seed={seed}"])
    path = resolve_model_path(cfg.model, cfg.task)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    split = get_task(cfg.task.name).load_prompts(cfg.task)
    reward = get_reward(cfg.task)
    keys = sorted(split.train[0].payload)
    dataset = Dataset.from_list([{"prompt": p.text, **p.payload} for p in split.train])
    val = [p for p in split.val for _ in range(cfg.eval.n)]  # mean@n, as tidal evaluates
    history: dict[str, dict[int, float]] = {"eval/pass_rate": {}, "compute/wall_s": {}, "compute/samples": {}}
    samples_per_step = cfg.learner.groups_per_step * cfg.sampling.n

    def rewards(prompts, completions, **columns):
        return [float(reward(text, {k: columns[k][i] for k in keys})) for i, text in enumerate(completions)]

    class Evaluate(TrainerCallback):
        def __init__(self):
            self.start = time.perf_counter()

        def record(self, step: int, model) -> None:
            history["compute/wall_s"][step] = time.perf_counter() - self.start
            history["compute/samples"][step] = step * samples_per_step
            if step == 0 or step % max(cfg.eval.every, 1) == 0 or step == cfg.learner.max_steps:
                model.eval()
                with torch.no_grad():
                    history["eval/pass_rate"][step] = pass_rate(model, tokenizer, val, reward, cfg.eval.temperature,
                                                                cfg.sampling.max_tokens)
                model.train()
            if step == 0:  # times count from the end of the step-0 evaluation, as for tidal's runs
                history["compute/wall_s"][0] = time.perf_counter() - self.start

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.start = time.perf_counter()
            self.record(0, model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.record(state.global_step, model)

    optim, loss = cfg.learner.optim, cfg.learner.loss
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, use_cpu=True, report_to="none", save_strategy="no", logging_steps=10**9, seed=seed,
            max_steps=cfg.learner.max_steps, per_device_train_batch_size=samples_per_step,
            num_generations=cfg.sampling.n, max_completion_length=cfg.sampling.max_tokens,
            temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
            max_grad_norm=optim.max_grad_norm or 1e9,
            beta=0.0, loss_type=loss.type.value if loss.type.value in ("cispo",) else "dapo",
            epsilon_high=loss.eps_max if loss.type.value == "cispo" else None,
            scale_rewards=cfg.learner.advantage_norm.value)
        # tidal's own optimizer and lr schedule (warmup, then constant or decaying), stepped once per step
        adamw = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                  weight_decay=optim.weight_decay)
        schedule = torch.optim.lr_scheduler.LambdaLR(adamw, lambda s: lr_factor(cfg.learner, s))
        trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Evaluate()], optimizers=(adamw, schedule))
        trainer.train()
    return history


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", help="preset or YAML file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_intermixed_args()
    print(json.dumps(trl_history(args.config, args.seed, args.overrides)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
