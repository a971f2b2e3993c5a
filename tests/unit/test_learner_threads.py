"""How many threads a learner rank computes with: one by default, the rank's cores where its optimizer
step runs on the host (fsdp.cpu_offload), or what learner.torch_threads says."""

from dataclasses import replace

import pytest

from tidal.config import ConfigError, LearnerConfig, load_config
from tidal.learner.build import learner_threads


def offloaded(**keys) -> LearnerConfig:
    lc = LearnerConfig(**keys)
    return replace(lc, fsdp=replace(lc.fsdp, enabled=True, cpu_offload=True))


def test_one_thread_by_default_and_the_ranks_share_of_cores_with_offload():
    assert learner_threads(LearnerConfig(), cores=16, local_ranks=1) == 1
    assert learner_threads(offloaded(), cores=64, local_ranks=4) == 16  # AdamW on the host: the rank's cores
    assert learner_threads(offloaded(), cores=3, local_ranks=4) == 1
    assert learner_threads(offloaded(torch_threads=2), cores=64, local_ranks=1) == 2  # what the user said


def test_a_negative_thread_count_is_refused():
    with pytest.raises(ConfigError, match="learner.torch_threads"):
        load_config(None, ["learner.torch_threads=-1"])
