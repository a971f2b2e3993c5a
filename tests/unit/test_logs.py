"""Refusals of what peers send are logged sparsely: a key holder's junk cannot fill the disk."""

import logging

from tidal.logs import SparseLog, power_of_ten


def test_a_kind_is_logged_at_its_1st_10th_and_100th_occurrence_with_its_count(caplog):
    sparse = SparseLog(logging.getLogger("tidal.test"))
    with caplog.at_level(logging.WARNING, logger="tidal.test"):
        for i in range(1000):
            sparse.warning("junk", "rejected frame %d", i)
        sparse.warning("other", "another kind")
    assert [r.getMessage() for r in caplog.records] == [
        "rejected frame 0 (#1 of junk)",
        "rejected frame 9 (#10 of junk)",
        "rejected frame 99 (#100 of junk)",
        "rejected frame 999 (#1000 of junk)",
        "another kind (#1 of other)",
    ]
    assert sparse.counts == {"junk": 1000, "other": 1}
    assert [n for n in range(1, 2001) if power_of_ten(n)] == [1, 10, 100, 1000] and not power_of_ten(0)
