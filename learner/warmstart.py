"""Supervised warm start of the tiny model, so RL starts from a non-zero pass rate.

Trains on the task's training split (never the held-out one) until greedy decoding solves
`target_greedy_pass_rate` of the held-out prompts, then saves the model. With `format_noise`
the teacher is sloppy about stopping: that fraction of its answers carry one or two stray
characters before <eos>. The model learns the arithmetic (greedy decoding is right) but often
fails the exact-match reward when sampling, like a pretrained model that knows answers but
not the output format; RL has to teach it to stop, a gain that shows within minutes on CPU. The
result is cached under `model.cache_dir/<hash of everything that shapes it>`.
"""
from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import torch

from tidal.config import ModelConfig, TaskConfig, WarmStartConfig
from tidal.kernels import logprobs as fused_logprobs
from tidal.tasks import Prompt, encode_prompt, get_task
from tidal.tiny import build_tiny_model, save_model

log = logging.getLogger(__name__)


def build_tiny(model: ModelConfig, task: TaskConfig, path: Path, progress=print) -> None:
    """Build the tiny model, warm-start it on the task's training split and save it at `path`."""
    task_mod = get_task(task.name)
    progress(f"building the warm-started tiny model at {path}")
    split = task_mod.load_prompts(task)
    net, tokenizer = build_tiny_model(model.tiny, task_mod.ALPHABET, model.tiny.warmstart.seed)
    warm_start(net, tokenizer, split.train, split.val, task_mod.reward, model.tiny.warmstart, progress)
    save_model(net, tokenizer, path)


def warm_start(net, tokenizer, train: list[Prompt], val: list[Prompt], reward, cfg: WarmStartConfig, progress) -> float:
    rng = random.Random(cfg.seed)
    optim = torch.optim.AdamW(net.parameters(), lr=cfg.lr, betas=(0.9, 0.99))
    start, greedy = time.monotonic(), 0.0
    for step in range(1, cfg.max_steps + 1):
        batch = [with_stray_suffix(p, rng) if rng.random() < cfg.format_noise else p
                 for p in (rng.choice(train) for _ in range(cfg.batch_size))]
        loss = sft_loss(net, tokenizer, batch)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if step % cfg.check_every == 0:
            greedy = pass_rate(net, tokenizer, val, reward, temperature=0.0)
            progress(f"warm start step {step}: loss {loss.item():.3f}, greedy val pass rate {greedy:.3f} "
                     f"({time.monotonic() - start:.0f} s)")
            if greedy >= cfg.target_greedy_pass_rate:
                break
    sampled = pass_rate(net, tokenizer, val, reward, temperature=1.0)
    progress(f"warm start done: greedy val pass rate {greedy:.3f}, sampled (temperature 1.0) {sampled:.3f}")
    return greedy


def with_stray_suffix(p: Prompt, rng: random.Random) -> Prompt:
    """The same example with one or two stray characters after the right answer (a format slip)."""
    alphabet = "0123456789+="
    stray = "".join(rng.choice(alphabet) for _ in range(rng.choice((1, 2))))
    return Prompt(p.prompt_id, p.text, {**p.payload, "answer": p.payload["answer"] + stray})


def sft_loss(net, tokenizer, batch: list[Prompt]) -> torch.Tensor:
    """Mean token NLL of answer + <eos> given the prompt (prompt tokens are not trained)."""
    seqs = [(encode_prompt(tokenizer, p.text), encode_prompt(tokenizer, p.payload["answer"]) + [tokenizer.eos_token_id])
            for p in batch]
    max_len = max(len(a) + len(b) for a, b in seqs)
    ids = torch.full((len(seqs), max_len), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    predict_at, targets = [], []
    for i, (prompt, answer) in enumerate(seqs):
        full = prompt + answer
        ids[i, :len(full)] = torch.tensor(full)
        attn[i, :len(full)] = 1
        predict_at += [i * max_len + len(prompt) + j - 1 for j in range(len(answer))]
        targets += answer
    hidden = net.model(input_ids=ids, attention_mask=attn).last_hidden_state  # [B, L, D]
    hidden = hidden.reshape(-1, hidden.shape[-1])[torch.tensor(predict_at)]  # [tokens, D]
    logp, _ = fused_logprobs(hidden, net.lm_head.weight, torch.tensor(targets))
    return -logp.mean()


@torch.no_grad()
def pass_rate(net, tokenizer, prompts: list[Prompt], reward, temperature: float, max_new_tokens: int = 6) -> float:
    """Mean reward of one completion per prompt, greedy (temperature 0) or sampled; batched by prompt length."""
    by_len: dict[int, list[Prompt]] = {}
    for p in prompts:
        by_len.setdefault(len(encode_prompt(tokenizer, p.text)), []).append(p)
    total = 0.0
    for group in by_len.values():
        ids = torch.tensor([encode_prompt(tokenizer, p.text) for p in group])
        out = ids
        for _ in range(max_new_tokens):
            logits = net(input_ids=out).logits[:, -1].float()  # [B, V]
            token = (logits.argmax(-1, keepdim=True) if temperature == 0
                     else torch.multinomial((logits / temperature).softmax(-1), 1))
            out = torch.cat([out, token], dim=1)
        for p, row in zip(group, out[:, ids.shape[1]:].tolist()):
            row = row[:row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row
            total += reward(tokenizer.decode(row, skip_special_tokens=True), p.payload)
    return total / max(len(prompts), 1)
