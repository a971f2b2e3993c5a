"""Supervised warm start of the tiny model, so RL starts from a non-zero pass rate.

Trains on the task's training split (never the held-out one) until the pass rate sampled at
temperature 1.0 on held-out prompts reaches `target_pass_rate`, then saves the model. The
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
from tidal.tasks import Prompt, get_task
from tidal.tiny import build_tiny_model, cache_key, save_model

log = logging.getLogger(__name__)


def ensure_model(model: ModelConfig, task: TaskConfig, progress=print) -> str:
    """The model directory to serve and train: model.path, or the cached (or new) tiny model."""
    if model.path:
        if not (Path(model.path) / "config.json").is_file():
            raise FileNotFoundError(f"model.path = {model.path!r} is not a Hugging Face model directory")
        return model.path
    task_mod = get_task(task.name)
    path = Path(model.cache_dir).expanduser() / f"tiny-{task.name}-{cache_key(model.tiny, task, task_mod.ALPHABET)}"
    if (path / "config.json").is_file():
        progress(f"warm-started model found in cache: {path}")
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    split = task_mod.load_prompts(task)
    net, tokenizer = build_tiny_model(model.tiny, task_mod.ALPHABET, model.tiny.warmstart.seed)
    warm_start(net, tokenizer, split.train, split.val, task_mod.reward, model.tiny.warmstart, progress)
    save_model(net, tokenizer, path)
    return str(path)


def warm_start(net, tokenizer, train: list[Prompt], val: list[Prompt], reward, cfg: WarmStartConfig, progress) -> float:
    rng = random.Random(cfg.seed)
    optim = torch.optim.AdamW(net.parameters(), lr=cfg.lr, betas=(0.9, 0.99))
    start, pass_rate = time.monotonic(), 0.0
    for step in range(1, cfg.max_steps + 1):
        batch = [rng.choice(train) for _ in range(cfg.batch_size)]
        loss = sft_loss(net, tokenizer, batch)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if step % cfg.check_every == 0:
            pass_rate = sampled_pass_rate(net, tokenizer, val, reward)
            progress(f"warm start step {step}: loss {loss.item():.3f}, sampled val pass rate {pass_rate:.3f} "
                     f"({time.monotonic() - start:.0f} s)")
            if pass_rate >= cfg.target_pass_rate:
                break
    return pass_rate


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def sft_loss(net, tokenizer, batch: list[Prompt]) -> torch.Tensor:
    """Mean token NLL of answer + <eos> given the prompt (prompt tokens are not trained)."""
    seqs = [(_encode(tokenizer, p.text), _encode(tokenizer, p.payload["answer"]) + [tokenizer.eos_token_id])
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
def sampled_pass_rate(net, tokenizer, prompts: list[Prompt], reward, max_new_tokens: int = 5) -> float:
    """Mean reward of one temperature-1.0 sample per prompt (prompts batched by length)."""
    by_len: dict[int, list[Prompt]] = {}
    for p in prompts:
        by_len.setdefault(len(_encode(tokenizer, p.text)), []).append(p)
    total = 0.0
    for group in by_len.values():
        ids = torch.tensor([_encode(tokenizer, p.text) for p in group])
        out = ids
        for _ in range(max_new_tokens):
            logits = net(input_ids=out).logits[:, -1].float()  # [B, V]
            out = torch.cat([out, torch.multinomial(logits.softmax(-1), 1)], dim=1)
        for p, row in zip(group, out[:, ids.shape[1]:].tolist()):
            row = row[:row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row
            total += reward(tokenizer.decode(row, skip_special_tokens=True), p.payload)
    return total / max(len(prompts), 1)
