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
from collections.abc import Callable
from pathlib import Path

import torch

from tidal.config import ModelConfig, TaskConfig, WarmStartConfig
from tidal.kernels import logprobs as fused_logprobs
from tidal.tasks import (
    ChatRenderer,
    Prompt,
    PromptEncoder,
    encode_prompt,
    get_task,
)
from tidal.tiny import OwnTask, build_tiny_model, max_positions, save_model

log = logging.getLogger(__name__)

Slip = Callable[[str, random.Random], str]  # the teacher's answer -> the answer it gives when sloppy


def build_tiny(model: ModelConfig, task: TaskConfig, path: Path, progress=print) -> None:
    """Build the tiny model, warm-start it on the task's training split and save it at `path`."""
    task_mod = get_task(task.name)
    progress(f"building the warm-started tiny model at {path}")
    if getattr(task_mod, "ALPHABET", None) is None:
        return build_own_tiny(model, OwnTask.of(task_mod, task), path, progress)
    split = task_mod.load_prompts(task)
    net, tokenizer = build_tiny_model(
        model.tiny,
        task_mod.ALPHABET,
        model.tiny.warmstart.seed,
        max_positions(task_mod),
        getattr(task_mod, "CHAT_TEMPLATE", None),
    )
    demonstrate = getattr(task_mod, "demonstration", None)
    if demonstrate is not None:
        teacher = Teacher(tokenizer, task, demonstrate)
        warm_start_episodes(net, teacher, split.train, split.val, model.tiny.warmstart, progress)
    else:
        slip = getattr(task_mod, "teacher_slip", None) or stray_suffix(task_mod.ALPHABET)
        warm_start(net, tokenizer, split.train, split.val, task_mod.reward, slip, model.tiny.warmstart, progress)
    save_model(net, tokenizer, path)


def build_own_tiny(model: ModelConfig, own: OwnTask, path: Path, progress) -> None:
    """A task's own tiny model: taught to write each training prompt's answer, until greedy decoding writes
    the held-out ones exactly (the task's own reward may want more; RL teaches that)."""
    net, tokenizer = build_tiny_model(model.tiny, own.alphabet, model.tiny.warmstart.seed, own.positions)
    prompts = [Prompt(i, text, {"answer": answer}) for i, (text, answer) in enumerate(own.pairs)]
    train, val = prompts[: own.num_train], prompts[own.num_train :] or prompts[: own.num_train]
    exact = lambda text, payload: float(text == payload["answer"])  # noqa: E731
    warm_start(net, tokenizer, train, val, exact, stray_suffix(own.alphabet), model.tiny.warmstart, progress)
    save_model(net, tokenizer, path)


def warm_start(
    net, tokenizer, train: list[Prompt], val: list[Prompt], reward, slip: Slip, cfg: WarmStartConfig, progress
) -> float:
    """SFT on `train` (a `cfg.format_noise` share of answers with the teacher's slip) until greedy decoding
    passes cfg.target_greedy_pass_rate of `val` at cfg.stable_checks checks in a row; returns that greedy
    pass rate."""
    rng = random.Random(cfg.seed)
    # room for the longest answer, its <eos> and a slip's characters (at least the 6 tokens used before)
    max_new = max(6, max(len(encode_prompt(tokenizer, p.payload["answer"])) for p in val) + 2)
    optim = torch.optim.AdamW(net.parameters(), lr=cfg.lr, betas=(0.9, 0.99))
    start, greedy, in_a_row = time.monotonic(), 0.0, 0
    for step in range(1, cfg.max_steps + 1):
        batch = [
            Prompt(p.prompt_id, p.text, {**p.payload, "answer": slip(p.payload["answer"], rng)})
            if rng.random() < cfg.format_noise
            else p
            for p in (rng.choice(train) for _ in range(cfg.batch_size))
        ]
        loss = sft_loss(net, tokenizer, batch)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if step % cfg.check_every == 0:
            greedy = pass_rate(net, tokenizer, val, reward, temperature=0.0, max_new_tokens=max_new)
            progress(
                f"warm start step {step}: loss {loss.item():.3f}, greedy val pass rate {greedy:.3f} "
                f"({time.monotonic() - start:.0f} s)"
            )
            in_a_row = in_a_row + 1 if greedy >= cfg.target_greedy_pass_rate else 0
            if in_a_row >= cfg.stable_checks:
                break
    sampled = pass_rate(net, tokenizer, val, reward, temperature=1.0, max_new_tokens=max_new)
    progress(f"warm start done: greedy val pass rate {greedy:.3f}, sampled (temperature 1.0) {sampled:.3f}")
    return greedy


class Teacher:
    """A task's demonstrated episodes (`demonstration(prompt, cfg, rng, sloppy)`: the messages after the
    prompt) as token ids: the model's turns (trained on, each ended by <eos>) and the environment's,
    rendered through the chat template as the actor renders them (read, not trained on)."""

    def __init__(self, tokenizer, task: TaskConfig, demonstrate):
        self.tokenizer, self.task, self.demonstrate = tokenizer, task, demonstrate
        self.encode = PromptEncoder.for_task(tokenizer, task)
        self.renderer = ChatRenderer(tokenizer, task.chat_template, self.encode.tools)
        self.stop_text = tokenizer.decode([tokenizer.eos_token_id], skip_special_tokens=False)

    def __call__(self, prompt: Prompt, rng: random.Random, sloppy: bool) -> tuple[list[int], list[int], list[bool]]:
        """(prompt tokens, completion tokens, which completion tokens the model wrote)."""
        completion, trained, pending = [], [], []
        for message in [*self.demonstrate(prompt, self.task, rng, sloppy), None]:
            if message is not None and message["role"] != "assistant":
                pending.append(message)
                continue
            if pending:
                reply = self.renderer.increment(pending, self.stop_text)
                completion += reply
                trained += [False] * len(reply)
                pending = []
            if message is not None:
                turn = encode_prompt(self.tokenizer, message["content"]) + [self.tokenizer.eos_token_id]
                completion += turn
                trained += [True] * len(turn)
        return self.encode(prompt), completion, trained


def warm_start_episodes(
    net, teacher: Teacher, train: list[Prompt], val: list[Prompt], cfg: WarmStartConfig, progress
) -> float:
    """SFT on demonstrated episodes of `train` (a `cfg.format_noise` share of them sloppy) until the
    model, fed each held-out episode up to each of its turns, writes every turn of a `cfg.target_greedy_
    pass_rate` share of them greedily as the teacher does (then a greedy episode passes: the environment
    answers it as it answered the teacher)."""
    rng = random.Random(cfg.seed)
    optim = torch.optim.AdamW(net.parameters(), lr=cfg.lr, betas=(0.9, 0.99))
    checks = [teacher(p, rng, sloppy=False) for p in val]
    start, greedy, in_a_row = time.monotonic(), 0.0, 0
    for step in range(1, cfg.max_steps + 1):
        batch = [
            teacher(p, rng, sloppy=rng.random() < cfg.format_noise)
            for p in (rng.choice(train) for _ in range(cfg.batch_size))
        ]
        loss = -_completion_logprobs(net, teacher.tokenizer, batch).mean()  # per trained token
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if step % cfg.check_every == 0:
            greedy = _teacher_forced_exact(net, teacher.tokenizer, checks)
            progress(
                f"warm start step {step}: loss {loss.item():.3f}, held-out episodes written exactly "
                f"{greedy:.3f} ({time.monotonic() - start:.0f} s)"
            )
            in_a_row = in_a_row + 1 if greedy >= cfg.target_greedy_pass_rate else 0
            if in_a_row >= cfg.stable_checks:
                break
    progress(f"warm start done: held-out episodes written exactly (greedy) {greedy:.3f}")
    return greedy


def _completion_hidden(net, tokenizer, seqs) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Hidden states that predict each trained completion token of `seqs` (prompt, completion, trained),
    padded to the longest; their targets; and how many each sequence has."""
    max_len = max(len(p) + len(c) for p, c, _ in seqs)
    ids = torch.full((len(seqs), max_len), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    predict_at, targets, counts = [], [], []
    for i, (prompt, completion, trained) in enumerate(seqs):
        full = prompt + completion
        ids[i, : len(full)] = torch.tensor(full)
        attn[i, : len(full)] = 1
        mine = [j for j in range(len(completion)) if trained[j]]
        predict_at += [i * max_len + len(prompt) + j - 1 for j in mine]
        targets += [completion[j] for j in mine]
        counts.append(len(mine))
    hidden = net.model(input_ids=ids, attention_mask=attn).last_hidden_state  # [B, L, D]
    return hidden.reshape(-1, hidden.shape[-1])[torch.tensor(predict_at)], torch.tensor(targets), counts


def _completion_logprobs(net, tokenizer, seqs, chunk_tokens: int = 4096) -> torch.Tensor:
    """Log-probabilities of every trained completion token of `seqs`, a chunk of similar lengths at a time."""
    out = []
    for chunk in by_length(seqs, chunk_tokens):
        hidden, targets, _ = _completion_hidden(net, tokenizer, chunk)
        out.append(fused_logprobs(hidden, net.lm_head.weight, targets)[0])
    return torch.cat(out)


@torch.no_grad()
def _teacher_forced_exact(net, tokenizer, seqs, batch: int = 64) -> float:
    """Share of `seqs` whose every trained token is the model's greedy choice given what precedes it."""
    exact = 0
    for i in range(0, len(seqs), batch):
        hidden, targets, counts = _completion_hidden(net, tokenizer, seqs[i : i + batch])
        right = (net.lm_head(hidden).argmax(-1) == targets).tolist()
        for count in counts:
            exact += all(right[:count])
            right = right[count:]
    return exact / max(len(seqs), 1)


def stray_suffix(alphabet: str) -> Slip:
    """The default slip (a task may define its own, `teacher_slip`): one or two stray characters of the
    task's alphabet after the right answer."""

    def slip(answer: str, rng: random.Random) -> str:
        return answer + "".join(rng.choice(alphabet) for _ in range(rng.choice((1, 2))))

    return slip


def sft_loss(net, tokenizer, batch: list[Prompt], chunk_tokens: int = 4096) -> torch.Tensor:
    """Mean token NLL of answer + <eos> given the prompt (prompt tokens are not trained)."""
    seqs = [
        (encode_prompt(tokenizer, p.text), encode_prompt(tokenizer, p.payload["answer"]) + [tokenizer.eos_token_id])
        for p in batch
    ]
    return -_completion_logprobs(net, tokenizer, [(p, a, [True] * len(a)) for p, a in seqs], chunk_tokens).mean()


def by_length(seqs: list, chunk_tokens: int) -> list[list]:
    """`seqs` (prompt, completion, ...) sorted by length and cut into chunks of at most `chunk_tokens`
    padded tokens, so that a few long sequences do not pad every short one."""
    seqs = sorted(seqs, key=lambda s: len(s[0]) + len(s[1]))
    chunks, start = [], 0
    for end in range(1, len(seqs) + 1):
        if end == len(seqs) or (end + 1 - start) * (len(seqs[end][0]) + len(seqs[end][1])) > chunk_tokens:
            chunks.append(seqs[start:end])
            start = end
    return chunks


@torch.no_grad()
def pass_rate(net, tokenizer, prompts: list[Prompt], reward, temperature: float, max_new_tokens: int = 6) -> float:
    """Mean reward of one completion per prompt, greedy (temperature 0) or sampled; batched by prompt length."""
    by_len: dict[int, list[Prompt]] = {}
    for p in prompts:
        by_len.setdefault(len(encode_prompt(tokenizer, p.text)), []).append(p)
    total = 0.0
    for group in by_len.values():
        ids = torch.tensor([encode_prompt(tokenizer, p.text) for p in group])
        out, step_ids, cache = ids, ids, None
        for _ in range(max_new_tokens):
            result = net(input_ids=step_ids, past_key_values=cache, use_cache=True)
            logits, cache = result.logits[:, -1].float(), result.past_key_values  # [B, V]
            step_ids = (
                logits.argmax(-1, keepdim=True)
                if temperature == 0
                else torch.multinomial((logits / temperature).softmax(-1), 1)
            )
            out = torch.cat([out, step_ids], dim=1)
            if (out[:, ids.shape[1] :] == tokenizer.eos_token_id).any(dim=1).all():
                break  # every row has ended
        for p, row in zip(group, out[:, ids.shape[1] :].tolist()):
            row = row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row
            total += reward(tokenizer.decode(row, skip_special_tokens=True), p.payload)
    return total / max(len(prompts), 1)
