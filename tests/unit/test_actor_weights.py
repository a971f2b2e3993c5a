"""Which announcements an actor loads: newer versions, and any version of a new learner process."""

from types import SimpleNamespace

from tidal.actor.loop import Actor
from tidal.broker.schema import WeightUpdate
from tidal.config import ActorConfig


def update(version: int, incarnation: str) -> WeightUpdate:
    return WeightUpdate(
        version=version, transport="file", location="/w", manifest=[], checksum="c", incarnation=incarnation
    )


def test_a_resumed_learners_lower_versions_replace_an_abandoned_lineage():
    actor = Actor(ActorConfig(), SimpleNamespace(version=12), transport=None, receiver=None)
    actor.loaded_incarnation = "old"
    assert actor.is_loaded(update(12, "old")) and actor.is_loaded(update(11, "old"))
    assert not actor.is_loaded(update(13, "old"))
    assert not actor.is_loaded(update(10, "new"))  # the learner restarted from its step-10 checkpoint
    actor.note_announcement(update(12, "old"))
    actor.note_announcement(update(10, "new"))
    assert actor.latest.incarnation == "new" and actor.swap_wanted.is_set()


def test_the_rotary_reload_warning_is_filtered_and_no_other(caplog):
    import logging

    from tidal.actor.worker_ext import RELOAD_LOGGER, quiet_harmless_reload_warnings

    quiet_harmless_reload_warnings()
    quiet_harmless_reload_warnings()  # once per reload: the filter is added once
    logger = logging.getLogger(RELOAD_LOGGER)
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=RELOAD_LOGGER):
        logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "QKVParallelLinear")
    assert [r.getMessage() for r in caplog.records] == ["QKVParallelLinear: Failed to load weights"]
