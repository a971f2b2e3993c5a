"""How the learner's bookkeeping grows with the number of groups a run has seen: the group book
(outstanding, the remembered consumed and dead ids) in memory and in the checkpoint's JSON.

    python bench/state_growth.py --groups 1000000

Prints one JSON line per checkpoint of the simulated run (groups so far, bytes of the book's
checkpoint JSON, traced Python memory of the book), groups released 16 at a time and trained.
"""

import argparse
import json
import tempfile
import tracemalloc
from pathlib import Path

from tidal.learner.rank0.groups import GroupBook, Release
from tidal.learner.rank0.ledger import Ledger


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=1_000_000)
    parser.add_argument("--per-step", type=int, default=16)
    parser.add_argument("--points", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tracemalloc.start()
        book = GroupBook(Ledger(Path(tmp) / "ledger.jsonl"))
        step, every = 0, args.groups // args.points
        for start in range(0, args.groups, args.per_step):
            ids = [f"run-20261130-000000-{i}" for i in range(start, start + args.per_step)]
            with book.cond:
                book.release({gid: Release(i, step, 8, "0123456789abcdef") for i, gid in enumerate(ids)})
            for gid in ids:
                book.claim(gid)
            step += 1
            book.trained(step, ids)
            if (start + args.per_step) % every < args.per_step:
                size = len(json.dumps(book.state_dict()))
                print(
                    json.dumps(
                        {
                            "groups": start + args.per_step,
                            "checkpoint_json_bytes": size,
                            "traced_bytes": tracemalloc.get_traced_memory()[0],
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
