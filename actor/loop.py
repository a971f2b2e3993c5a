"""The actor: pull prompt groups, sample them on vLLM, score them, stream finished groups out.

    learner ──groups──► fill_slots ──► run_group (wait for min_version → n episodes → samples) ──► RolloutGroup
                                        (episode: turns, tools, the environment's reward;
                                         length_control: interruptions, overlong penalty)
    learner ──announcements──► listen ──► apply_newest ──► receiver.apply (engine: pause(keep) → load → resume)
                               heartbeats ──► learner (version, outstanding groups)

Concurrent tasks on one asyncio loop. Announcements are the one way an actor hears of new
weights: the first one (the current weights) is applied before the hello, later ones while
requests are in flight, which continue under the new weights; every token's version is recorded
in the rollout's version spans.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

from tidal.actor.episode import Episodes
from tidal.broker.base import ActorTransport
from tidal.broker.schema import Heartbeat, PromptGroup, RolloutGroup, Shutdown, WeightUpdate
from tidal.broker.weights import EngineStuck, WeightReceiver
from tidal.config import ActorConfig
from tidal.health import HealthFile
from tidal.prometheus import StateClock

log = logging.getLogger(__name__)

MAX_WEIGHT_LOAD_FAILURES = 10  # in a row would mean the weight folder is unreachable: stop loudly
RETRY_TORN_S = (1.0, 30.0)  # a torn engine retries the newest version after this long, doubling up to a cap
CATCH_UP_TIMEOUT_S = 30.0  # how long a joining actor waits to hear the current weights before starting without
# where an actor's time goes: holding no work, every group it holds waiting for newer weights, or generating
IDLE, WAITING_FOR_WEIGHTS, BUSY = "work", "weights", "busy"


class Actor:
    def __init__(
        self,
        cfg: ActorConfig,
        engine,
        transport: ActorTransport,
        receiver: WeightReceiver | None,
        episodes: Episodes | None = None,
    ):
        self.cfg = cfg
        self.engine = engine  # tidal.actor.engine.Engine, or anything with its methods
        self.transport = transport
        self.receiver = receiver
        self.episodes = episodes  # runs each sample as an episode of the task's environment
        self.inflight_samples = 0
        # samples held at once: the engine runs max_inflight, the rest wait in its queue for a free slot
        self.capacity = cfg.max_inflight + (cfg.max_inflight if cfg.max_queued < 0 else cfg.max_queued)
        self.outstanding: dict[str, PromptGroup] = {}
        self.tasks: set[asyncio.Task] = set()  # the loop holds tasks weakly: keep every one until it ends
        self.latest: WeightUpdate | None = None  # newest announcement heard
        self.version_changed = asyncio.Condition()
        self.slots_freed = asyncio.Event()
        self.stats: Counter[str] = Counter()
        self.stop = asyncio.Event()
        self.stop_reason = ""
        self.failure: Exception | None = None
        self.last_swap_paused_s = 0.0
        self.last_pull_s = 0.0  # the latest weight update, from taking it up to loaded (the pause inside it)
        self.paused_total_s = 0.0
        self.pulled_total_s = 0.0
        self.on_weights_loaded: Callable[[float, float], None] | None = None  # (pull s, paused s): metrics
        self.clock = StateClock((IDLE, WAITING_FOR_WEIGHTS, BUSY), IDLE)
        self.waiting_for_weights = 0  # groups in hand waiting for their min_version
        self.swap_wanted = asyncio.Event()
        self.retry_s = RETRY_TORN_S[0]  # the wait before a torn engine's next try
        self.loaded_incarnation = ""  # the learner process whose weights the engine runs ("" = from disk)
        self._engine_info: dict[str, str] | None = None

    async def run(self) -> str:
        """Runs until the learner says shutdown; returns its reason."""
        await self.catch_up()
        if self.stop.is_set():  # the run ended before this actor joined it
            return self.stop_reason
        await self.send_heartbeat(hello=True)
        loops = [
            self.spawn(coro) for coro in (self.fill_slots(), self.apply_newest(), self.listen(), self.heartbeats())
        ]
        stopper = self.spawn(self.stop.wait())
        done, _ = await asyncio.wait([*loops, stopper], return_when=asyncio.FIRST_COMPLETED)
        for task in list(self.tasks):
            task.cancel()
        for task in done:
            if task is not stopper and task.exception():
                raise task.exception()
        if self.failure is not None:
            raise self.failure
        return self.stop_reason

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    # ---- work ----------------------------------------------------------------------------------

    async def fill_slots(self) -> None:
        """Ask for groups whenever slots are free; start each granted group as its own task."""
        while True:
            free = self.capacity - self.inflight_samples
            if free <= 0:
                self.slots_freed.clear()
                await self.slots_freed.wait()
                continue
            for group in await self.transport.request_work(free, timeout_s=1.0):
                if group.group_id in self.outstanding:
                    continue  # redelivered to us while we work on it (at-least-once): one copy is enough
                self.inflight_samples += group.n
                self.outstanding[group.group_id] = group
                self.spawn(self.guard(self.run_group(group)))
            self.settle()

    async def guard(self, coro) -> None:
        """A failing group must stop the actor loudly, not vanish in a detached task."""
        try:
            await coro
        except Exception as err:
            log.exception("rollout failed")
            self.failure = RuntimeError(f"rollout failed: {err!r}")
            self.stop.set()

    async def run_group(self, group: PromptGroup) -> None:
        queued = time.perf_counter()
        await self.wait_for_version(group.min_version)
        start = time.perf_counter()
        # environments and rewards run off the event loop: a slow one never stalls heartbeats, claims and swaps
        episodes = await self.episodes.run(self.engine, group)
        completions = [e.completion for e in episodes]
        # the overlong penalty (when the group asks) is added there; Sample.raw_reward keeps the task's own reward
        samples = [e.sample(group.sampling) for e in episodes]
        await self.transport.send_rollout(
            RolloutGroup.pack(
                samples,
                group_id=group.group_id,
                prompt_id=group.prompt_id,
                actor_id=self.cfg.id,
                prompt_tokens=group.prompt_tokens,
                eval_version=group.eval_version,
                gen_seconds=time.perf_counter() - start,
                queue_seconds=start - queued,
                finished_at=time.time(),
            )
        )
        self.stats["groups"] += 1
        injected = sum(end - begin for c in completions for begin, end in c.injected_spans)
        self.stats["tokens"] += sum(len(c.tokens) for c in completions) - injected  # generated, not injected
        if group.sampling.interrupt is not None:  # an interruption's text is a sample's first injected span
            self.stats["interrupted_samples"] += sum(bool(c.injected_spans) for c in completions)
        self.inflight_samples -= group.n
        del self.outstanding[group.group_id]
        self.settle()
        self.slots_freed.set()

    def settle(self) -> None:
        """Move the clock of where time goes to what the actor does now (called where that changes)."""
        if not self.outstanding:
            self.clock.enter(IDLE)
        elif self.waiting_for_weights >= len(self.outstanding):
            self.clock.enter(WAITING_FOR_WEIGHTS)
        else:
            self.clock.enter(BUSY)

    # ---- weights -------------------------------------------------------------------------------

    async def catch_up(self) -> None:
        """A joining or restarted actor loads the current weights before it says hello."""
        try:
            msg = await asyncio.wait_for(self.transport.next_announcement(), CATCH_UP_TIMEOUT_S)
        except TimeoutError:
            log.warning("heard no weights within %.0f s; starting with the model's own", CATCH_UP_TIMEOUT_S)
            return
        if isinstance(msg, Shutdown):
            self.stop_reason = msg.reason
            self.stop.set()
            return
        self.note_announcement(msg)
        if await self.load_newest(tolerate=True):
            log.info("caught up to weights v%d before taking work", self.engine.version)

    def note_announcement(self, update: WeightUpdate) -> None:
        if self.latest is None or update.version > self.latest.version or update.incarnation != self.latest.incarnation:
            self.latest = update
            self.swap_wanted.set()

    def is_loaded(self, update: WeightUpdate) -> bool:
        """Already running these weights or newer ones of the same learner; a restarted (resumed)
        learner's versions replace whatever an earlier learner process announced."""
        return update.version <= self.engine.version and update.incarnation == self.loaded_incarnation

    async def wait_for_version(self, min_version: int) -> None:
        if self.engine.version >= min_version:
            return
        self.waiting_for_weights += 1
        self.settle()
        try:
            async with self.version_changed:
                await self.version_changed.wait_for(lambda: self.engine.version >= min_version)
        finally:
            self.waiting_for_weights -= 1
            self.settle()

    async def apply_newest(self) -> None:
        """Apply the newest announcement heard; a slow load never queues stale versions."""
        while True:
            await self.swap_wanted.wait()
            await self.load_newest(tolerate=False)

    async def load_newest(self, tolerate: bool) -> bool:
        """Load the newest announced weights unless they run already; True when loaded. A failed
        load (a pruned or damaged file) waits for the next version; MAX_WEIGHT_LOAD_FAILURES in a row
        stop the actor unless `tolerate` (catching up: the groups' min_version makes us load later).
        A learner that cannot be reached (ConnectionError: it restarts, or is gone) never counts
        toward that: the broker says when the run ends. A transfer that failed part-way leaves the
        engine paused on a torn model, so the same version is tried again, after RETRY_TORN_S."""
        self.swap_wanted.clear()
        update = self.latest
        if update is None or self.is_loaded(update):
            return False
        started = time.perf_counter()
        try:
            paused_s = await self.receiver.apply(update, self.engine)
        except EngineStuck:
            raise  # no later update can load: stop, and be restarted
        except Exception as err:
            unreachable = isinstance(err, ConnectionError)
            log.warning(
                "could not load weights v%d (%s); %s",
                update.version,
                err,
                f"trying again in {self.retry_s:.0f} s" if self.torn() else "waiting for the next announcement",
            )
            self.stats["weight_load_failures"] += 1
            self.stats["weight_load_failures_in_a_row"] += not unreachable
            if self.torn():
                asyncio.get_running_loop().call_later(self.retry_s, self.swap_wanted.set)
                self.retry_s = min(self.retry_s * 2, RETRY_TORN_S[1])
            if not tolerate and self.stats["weight_load_failures_in_a_row"] >= MAX_WEIGHT_LOAD_FAILURES:
                raise RuntimeError(f"{MAX_WEIGHT_LOAD_FAILURES} weight loads failed; last: {err}") from err
            return False
        self.retry_s = RETRY_TORN_S[0]
        self.loaded_incarnation = update.incarnation
        self.stats["weight_updates"] += 1
        self.stats["weight_load_failures_in_a_row"] = 0
        self.last_swap_paused_s, self.last_pull_s = paused_s, time.perf_counter() - started
        self.paused_total_s += paused_s
        self.pulled_total_s += self.last_pull_s
        if self.on_weights_loaded is not None:
            self.on_weights_loaded(self.last_pull_s, paused_s)
        log.info(
            "weights v%d loaded (engine paused %.3f s, %d samples in flight)",
            update.version,
            paused_s,
            self.inflight_samples,
        )
        async with self.version_changed:
            self.version_changed.notify_all()
        return True

    def torn(self) -> bool:
        """The engine is paused on a model a failed transfer left part old, part new."""
        return bool(getattr(self.engine, "torn", False))

    async def listen(self) -> None:
        while True:
            msg = await self.transport.next_announcement()
            if isinstance(msg, Shutdown):
                self.stop_reason = msg.reason
                self.stop.set()
                return
            self.note_announcement(msg)

    # ---- liveness ------------------------------------------------------------------------------

    async def heartbeats(self) -> None:
        health = HealthFile(self.cfg.health_file, every_s=0)
        while True:
            health.touch()
            await asyncio.sleep(self.cfg.heartbeat_s)
            await self.send_heartbeat()

    async def send_heartbeat(self, hello: bool = False) -> None:
        if self._engine_info is None:
            self._engine_info = self.engine.info()
        await self.transport.heartbeat(
            Heartbeat(
                actor_id=self.cfg.id,
                version=self.engine.version,
                engine=self._engine_info,
                outstanding=list(self.outstanding),
                num_generated_tokens=self.stats["tokens"],
                weight_swap_paused_s=self.last_swap_paused_s,
                hello=hello,
                **self.flow(),
            )
        )

    def flow(self) -> dict[str, float]:
        """Where this actor's time went so far, as its heartbeat carries it to the learner."""
        seconds = self.clock.seconds()
        return {
            "uptime_s": sum(seconds.values()),
            "work_wait_s": seconds[IDLE],
            "weights_wait_s": seconds[WAITING_FOR_WEIGHTS],
            "weight_pause_s": self.paused_total_s,
            "weight_pulls_s": self.pulled_total_s,
            "weight_pull_s": self.last_pull_s,
        }
