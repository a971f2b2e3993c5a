"""`tidal` command line: run | learner | actor | prepare. Heavy imports are deferred so --help is instant."""
from __future__ import annotations

import argparse
import logging
import sys

from tidal.config import ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal", description="Asynchronous off-policy RL for LLMs.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="start a learner and actor processes and train")
    run.add_argument("config", help="YAML preset, e.g. configs/tiny.yaml")
    run.add_argument("overrides", nargs="*", help="key=value overrides, e.g. learner.max_steps=50")
    for role in ("learner", "actor"):
        r = sub.add_parser(role, help=f"run one {role} process (what the launcher and Kubernetes pods start)")
        r.add_argument("--config", required=True, help="YAML config (a preset or a run's resolved config.yaml)")
        r.add_argument("overrides", nargs="*", help="key=value overrides")
    prep = sub.add_parser("prepare", help="build (or find in the cache) the warm-started tiny model")
    prep.add_argument("config")
    prep.add_argument("overrides", nargs="*")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(getattr(args, "config", None), args.overrides)
    except ConfigError as err:
        print(f"tidal: {err}", file=sys.stderr)
        return 2
    if args.command == "run":
        from tidal.launcher import launch

        return launch(cfg)
    if args.command == "learner":
        from tidal.learner.main import main as learner_main

        return learner_main(cfg)
    if args.command == "actor":
        from tidal.actor.main import main as actor_main

        return actor_main(cfg)
    from tidal.learner.warmstart import ensure_model

    print(ensure_model(cfg.model, cfg.task))
    return 0


if __name__ == "__main__":
    sys.exit(main())
