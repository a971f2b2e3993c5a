"""Follow a chain with a lookup tool: the CPU agent task. Needs no download.

The prompt is a key, `372`. The model calls the tool, `[look(x=372)]`, which answers the next key,
`519`, or `519!` when that key ends the chain; the model looks up each key it is given until one
ends the chain, then answers that key: reward 1.0 for it, else 0.0. An episode takes as many turns
as the chain has links (one tool call each) and one more for the answer. The keys are 100-999, a
seeded permutation links each to the next and a seeded draw makes some of them ends (each with
probability END_SHARE), so chain lengths are geometric: half the episodes need at most 2 lookups,
one in 30 needs 8 or more (the cap is MAX_LINKS), and those take many times the median's tokens.
"""

from __future__ import annotations

import random
from functools import lru_cache

from tidal.config import ConfigError, TaskConfig
from tidal.tasks import Prompt, Split
from tidal.tasks.env import Env, Message, Turn

OPTIONS: dict[str, str] = {}  # task.kwargs: this task takes none

ALPHABET = "0123456789[]()=!>lokx"
MAX_POSITIONS = 256  # the longest chain's episode: MAX_LINKS lookups of ~19 tokens, the answer, the prompt
# the tiny model's chat template: a user's or tool's message ends in ">", the model's turn in <eos>
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}<eos>"
    "{% else %}{{ m.content }}>{% endif %}{% endfor %}"
)
KEYS = range(100, 1000)
END_SHARE = 0.4  # keys that end a chain
MAX_LINKS = 12  # lookups of the longest chain
SLIP = 0.5  # a sloppy teacher's chance of each of its slips


@lru_cache(maxsize=4)
def links(seed: int) -> dict[int, tuple[int, bool]]:
    """key -> (the next key, whether the next key ends the chain), for the task's seed."""
    rng = random.Random(f"chain-{seed}")
    order = list(KEYS)
    rng.shuffle(order)
    following = dict(zip(order, order[1:] + order[:1]))  # one cycle through every key
    ends = {k for k in KEYS if rng.random() < END_SHARE}
    run = 0
    for key in order:  # along the cycle: no chain longer than MAX_LINKS
        run = 0 if key in ends else run + 1
        if run == MAX_LINKS:
            ends.add(key)
            run = 0
    return {key: (following[key], following[key] in ends) for key in KEYS}


def walk(key: int, seed: int) -> list[int]:
    """The keys looked up from `key` on: the last one ends the chain."""
    table, out = links(seed), []
    while True:
        key, last = table[key]
        out.append(key)
        if last:
            return out


def load_prompts(cfg: TaskConfig) -> Split:
    """One prompt per key (shuffled by cfg.seed); the first num_val are held out."""
    keys = list(KEYS)
    random.Random(cfg.seed).shuffle(keys)
    if cfg.num_val >= len(keys):
        raise ConfigError(f"task.num_val = {cfg.num_val} leaves no training prompts ({len(keys)} keys)")
    prompts = [Prompt(prompt_id=key, text=str(key), payload={"answer": str(walk(key, cfg.seed)[-1])}) for key in keys]
    return Split(train=prompts[cfg.num_val :], val=prompts[: cfg.num_val])


class Environment(Env):
    """The lookup tool; the first turn that calls no tool is the answer."""

    options: dict[str, str] = {}  # env.kwargs: none

    def __init__(self, cfg: TaskConfig, kwargs: dict | None = None):
        super().__init__(cfg, kwargs)
        table = links(cfg.seed)

        def look(x: int) -> str:
            """The key that follows x in its chain, marked with ! when it ends the chain.

            Args:
                x: a key, 100 to 999
            """
            following, last = table[int(x)]
            return f"{following}{'!' if last else ''}"

        self.look = look

    def tools(self):
        return [self.look]

    def step(self, state: dict[str, str], reply: str) -> Turn:
        return Turn(done=True, reward=1.0 if reply.strip() == state["answer"] else 0.0)


def demonstration(prompt: Prompt, cfg: TaskConfig, rng: random.Random, sloppy: bool) -> list[Message]:
    """A teacher's episode after the prompt, for the tiny model's warm start. A sloppy teacher answers
    a key that does not end the chain yet (at each lookup, with probability SLIP) and copies the end
    mark into its answer (with probability SLIP): a model that learned from it follows the tool
    greedily, and when it samples, fails long chains more often than short ones."""
    keys = walk(int(prompt.text), cfg.seed)
    messages, key = [], int(prompt.text)
    for i, following in enumerate(keys):
        last = i == len(keys) - 1
        messages += [
            {"role": "assistant", "content": f"[look(x={key})]"},
            {"role": "tool", "content": f"{following}{'!' if last else ''}"},
        ]
        key = following
        if sloppy and not last and rng.random() < SLIP:
            break
    mark = "!" if sloppy and key == keys[-1] and rng.random() < SLIP else ""
    return [*messages, {"role": "assistant", "content": f"{key}{mark}"}]
