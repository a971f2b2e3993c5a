"""What can be checked before any process starts: the task and its data, the model and its
tokenizer, the prompts as the tokenizer encodes them. `tidal run` checks first and creates nothing
when a check fails (one line, exit 2)."""
from __future__ import annotations

from tidal.config import ConfigError, RunConfig


def preflight(cfg: RunConfig) -> list[str]:
    """One line per thing checked; raises ConfigError or FileNotFoundError naming what is wrong."""
    from tidal.models import resolve_model_path
    from tidal.tasks import PromptEncoder, get_task

    split = get_task(cfg.task.name).load_prompts(cfg.task)
    if not split.train:
        raise ConfigError(f"config key 'task.name' = {cfg.task.name!r}: the task gave no training prompts")
    found = [f"task {cfg.task.name}: {len(split.train)} training prompts, {len(split.val)} held out"]
    try:
        path = resolve_model_path(cfg.model, cfg.task)
    except FileNotFoundError:
        if cfg.model.path:
            raise
        return [*found, "model: the tiny model is not built yet (tidal run builds it)"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    encode = PromptEncoder.for_task(tokenizer, cfg.task, cfg.env.kwargs)
    longest = max(len(encode(p)) for p in split.train[:64] + split.val[:64])
    limit = cfg.actor.vllm.max_model_len
    if limit and longest + cfg.sampling.max_tokens > limit:
        raise ConfigError(f"config key 'actor.vllm.max_model_len' = {limit}: prompts of up to {longest} tokens plus "
                          f"sampling.max_tokens = {cfg.sampling.max_tokens} do not fit")
    return [*found, f"model {path}: tokenizer of {len(tokenizer)} tokens, prompts of up to {longest} tokens"]
