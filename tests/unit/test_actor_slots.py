"""How much work an actor holds: the engine's batch (actor.max_inflight) and a queue beyond it."""

import asyncio
from types import SimpleNamespace

import pytest

from tidal.actor.loop import Actor
from tidal.broker.schema import PromptGroup, SamplingParams, int32s
from tidal.config import ActorConfig


class Prompts:
    """A transport with prompts always waiting: grants whole groups of 8 while they fit."""

    def __init__(self):
        self.granted = 0

    async def request_work(self, max_samples: int, timeout_s: float) -> list[PromptGroup]:
        groups = []
        while max_samples >= 8:
            self.granted += 1
            groups.append(
                PromptGroup(
                    run_id="r",
                    group_id=f"g{self.granted}",
                    prompt_id=self.granted,
                    prompt_tokens=int32s([1, 2]),
                    task="t",
                    payload={},
                    n=8,
                    sampling=SamplingParams(),
                    min_version=0,
                )
            )
            max_samples -= 8
        await asyncio.sleep(0)
        return groups


async def held_samples(cfg: ActorConfig) -> int:
    async def never_done(*args, **kwargs):
        await asyncio.Event().wait()  # every sample still generating

    engine = SimpleNamespace(version=0, sample=never_done)
    actor = Actor(cfg, engine, Prompts(), receiver=None)
    filling = asyncio.create_task(actor.fill_slots())
    for _ in range(20):
        await asyncio.sleep(0)
    filling.cancel()
    for task in actor.tasks:
        task.cancel()
    return actor.inflight_samples


@pytest.mark.parametrize(("max_queued", "held"), [(-1, 64), (0, 32), (16, 48)])
def test_an_actor_holds_its_engines_batch_and_the_queue_beyond_it(max_queued, held):
    """A group keeps its slots until its longest sample is done: the queued samples start in the
    engine as soon as any running one finishes, instead of the engine running below its batch."""
    assert asyncio.run(held_samples(ActorConfig(max_inflight=32, max_queued=max_queued))) == held


def test_a_negative_queue_other_than_minus_one_is_a_config_error():
    from tidal.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="actor.max_queued"):
        load_config("configs/tiny.yaml", ["actor.max_queued=-2"])
