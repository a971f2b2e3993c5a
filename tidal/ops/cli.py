"""`tidal` command line: run | learner | actor | config | prepare | export | fit | sweep | plan-batch |
presets | keys | health.

Every role takes its config the same way: presets or YAML files, layered in order, then key=value
overrides (`tidal run tiny-scalerl my-overlay.yaml learner.max_steps=50`). Heavy imports are
deferred so --help is instant."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tidal.config import ConfigError, load_config

LAYERS_HELP = (
    "presets (tidal presets) or YAML files, layered in order, then key=value overrides, "
    "e.g. tiny-scalerl my-overlay.yaml learner.max_steps=50"
)
SKIP_HELP = (
    "leave out each curve's points below this fraction of its compute (the early transient); auto "
    "(the default) finds it by a rule, its intervals widened to the fit on every point unless the left-out "
    "points lie beyond the noise; 0 keeps every point"
)
TARGET_HELP = (
    "a pass rate: fit each curve against wall time too and name the run predicted to reach it "
    "soonest, with 90%% intervals"
)


def _skip(value: str) -> float | str | None:
    """--skip-fraction: auto, 0 (none) or a fraction, checked by the fit's window."""
    if value == "auto":
        return value
    try:
        return float(value) or None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: a fraction between 0 and 1, 0 (skip nothing) or auto") from None


def _layered(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    """CONFIG... [key=value ...]: the positional every config-taking command shares."""
    p.add_argument(
        "layers",
        nargs="*",
        metavar="CONFIG|key=value",
        help=LAYERS_HELP + (" (key=v1,v2,... becomes an axis of the grid)" if sweep else ""),
    )
    # what pods and scripts written for earlier releases pass; the same as a leading positional
    p.add_argument("--config", action="append", default=[], help=argparse.SUPPRESS)


def _split(args) -> tuple[list[str], list[str]]:
    """The configs and the overrides of a `layers` positional: an item with `=` is an override."""
    items = [*args.config, *args.layers]
    configs = [i for i in items if "=" not in i]
    if not configs:
        raise ConfigError(f"tidal {args.command} needs a config: a preset's name (tidal presets) or a YAML file")
    return configs, [i for i in items if "=" in i]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal", description="Asynchronous off-policy RL for LLMs.")
    p.add_argument("--version", action="version", version=f"tidal {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    roles = {
        "run": "start a learner and actor processes and train",
        "learner": "run the learner process (what the launcher and Kubernetes pods start)",
        "actor": "run one actor process; start more at any time to scale out",
        "prepare": "build (or find in the cache) the warm-started tiny model",
    }
    for name, text in roles.items():
        _layered(sub.add_parser(name, help=text))
    _resume_flags(sub)
    _config_parsers(sub)
    _tool_parsers(sub)
    _analysis_parsers(sub)
    return p


def _resume_flags(sub) -> None:
    sub.choices["run"].add_argument(
        "--overwrite",
        action="store_true",
        help="run_dir holds a run already: delete it and start over there (without it, or --resume, such a "
        "run_dir is refused)",
    )
    for name in ("run", "learner"):
        sub.choices[name].add_argument(
            "--resume",
            nargs="?",
            const="required",
            choices=("required", "auto", "fresh"),
            help="continue from the newest checkpoint in run_dir that verifies (same MLflow run, steps "
            "continue); `--resume auto` starts fresh when there is none at all (for pods that restart) "
            "and refuses (exit 2) when every one is damaged; `--resume fresh` then starts over them, "
            "setting them aside and clearing the run's broker streams and ledger",
        )
        sub.choices[name].add_argument(
            "--print-samples",
            nargs="?",
            type=int,
            const=3,
            default=0,
            metavar="N",
            help="show N (default 3) sampled training rollouts of each rollout table (every "
            "tracking.rollout_table_every steps): on the console for run, in the learner's log for learner",
        )


def _config_parsers(sub) -> None:
    config = sub.add_parser("config", help="show, check or explain a config without starting anything")
    what = config.add_subparsers(dest="action", required=True)
    _layered(what.add_parser("show", help="print the resolved config as YAML"))
    check = what.add_parser(
        "check",
        help="load the config, the task's data, the model path and its tokenizer; "
        "plan each GPU's and host's memory (docs/gpu.md)",
    )
    _layered(check)
    check.add_argument("--gpu-gib", type=float, help="plan for GPUs of this size (default: the visible GPUs')")
    check.add_argument("--gpus-per-node", type=int, help="GPUs a node (default: the visible ones, else 8)")
    check.add_argument("--host-gib", type=float, help="host memory a node (default: this machine's)")
    check.add_argument("--model-config", help="the model's config.json, where model.path is not on this machine")
    explain = what.add_parser("explain", help="a key's type, default and meaning (a section: its keys)")
    explain.add_argument("key", nargs="?", default="", help="e.g. staleness.max_lag, learner.loss or nothing")


def _tool_parsers(sub) -> None:
    export = sub.add_parser(
        "export",
        help="a run's checkpoint as a Hugging Face model folder (transformers, vLLM); "
        "a LoRA run's as its adapter (PEFT)",
    )
    export.add_argument("run_dir", help="the run's folder (runs/<name>-<time>)")
    export.add_argument("--step", type=int, help="the checkpoint's step (default: the newest)")
    export.add_argument(
        "--out",
        help="where the folder goes, new or empty (default: RUN_DIR/model-step-<N>, a LoRA "
        "run's RUN_DIR/adapter-step-<N>)",
    )
    export.add_argument(
        "--force",
        action="store_true",
        help="replace an earlier export (a folder with config.json or adapter_config.json)",
    )
    export.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: the adapter merged into the base model, a whole model folder (default: the adapter alone)",
    )
    sub.add_parser("presets", help="list the presets shipped with tidal (tidal run <name>)")
    keys = sub.add_parser("keys", help="make CURVE keys for the ZeroMQ transport (broker.zmq.keys_dir)")
    keys.add_argument("dir", help="the keys folder (existing keys are kept)")
    keys.add_argument("--actors", required=True, help="actor ids, comma-separated, e.g. actor-0,actor-1")
    ledger = sub.add_parser("ledger", help="check a run's ledger: every released prompt group met exactly one fate")
    ledger.add_argument("action", choices=["check"])
    ledger.add_argument("run_dir", help="the run's folder (runs/<name>-<time>)")
    ledger.add_argument(
        "--redis",
        nargs="?",
        const="",
        metavar="URL",
        help="also hold the run's Redis streams against the ledger: the Redis at URL (no URL: broker.redis.url "
        "of the run's config.yaml), the password from the variable named by broker.redis.password_env",
    )
    health = sub.add_parser("health", help="exit 0 if FILE was touched within --max-age-s (liveness probes)")
    health.add_argument("file")
    health.add_argument("--max-age-s", type=float, default=120.0)


def _analysis_parsers(sub) -> None:
    fit = sub.add_parser("fit", help="fit ScaleRL sigmoids to eval curves (MLflow runs or a CSV) and extrapolate")
    fit.add_argument("--csv", help="a CSV with columns compute,pass_rate")
    fit.add_argument("--tracking-uri", help="MLflow tracking URI holding the runs (default: MLFLOW_TRACKING_URI)")
    fit.add_argument("--runs", nargs="*", default=[], help="MLflow run ids")
    fit.add_argument("--compute-metric", default="compute/flops", help="x axis: compute/flops, compute/samples, ...")
    fit.add_argument("--predict", type=float, help="print the predicted pass rate at this compute")
    fit.add_argument("--fit-fraction", type=float, help="fit only points up to this fraction of the compute")
    fit.add_argument("--skip-fraction", type=_skip, default="auto", help=SKIP_HELP)
    fit.add_argument("--out", default="fit.png", help="where the plot goes")
    fit.add_argument("--target", type=float, help=TARGET_HELP)
    sweep = sub.add_parser("sweep", help="run a grid of configs (key=v1,v2,...) sequentially, then fit them")
    _layered(sweep, sweep=True)
    sweep.add_argument("--out", help="sweep folder (default runs/sweep-<time>)")
    sweep.add_argument("--compute-metric", default="compute/flops")
    sweep.add_argument("--target", type=float, help=TARGET_HELP)
    sweep.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="runs per grid point (learner.seed and actor.seed 0, 1, ...); --target pools them",
    )
    sweep.add_argument(
        "--fit-fraction", type=float, help="fit each run on this first fraction of its compute and predict the rest"
    )
    sweep.add_argument("--skip-fraction", type=_skip, default="auto", help=SKIP_HELP)
    plan = sub.add_parser("plan-batch", help="probe each batch size on the real engine and learner, and recommend one")
    _layered(plan)
    plan.add_argument("--batch-sizes", default="4,8,16,32", help="prompt groups per step to probe")
    plan.add_argument("--target", type=float, default=0.6, help="target val pass rate for samples-to-target")
    plan.add_argument("--tracking-uri", help="MLflow store of earlier runs (for samples-to-target)")
    plan.add_argument(
        "--runs",
        nargs="*",
        default=[],
        help="MLflow run ids at one or more batch sizes: the step each reached the target",
    )
    plan.add_argument(
        "--eval-every-groups",
        type=int,
        help="evaluate every this many prompt groups at every batch size (default: the config's "
        "eval.every x learner.groups_per_step)",
    )
    plan.add_argument("--probe-dir", help="keep the probe runs in this folder (default: a temporary one)")
    plan.add_argument("--out", default="plan-batch.png")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tidal")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        return "unknown"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, with configs and overrides allowed on both sides of flags
    (`tidal learner run.yaml --resume auto run_dir=/data`), which argparse alone does not do."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and (not hasattr(args, "layers") or any(e.startswith("-") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.layers = [*args.layers, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    simple = {
        "health": lambda: _health(args.file, args.max_age_s),
        "export": lambda: _export(args),
        "presets": _presets,
        "keys": lambda: _keys(args.dir, args.actors),
        "fit": lambda: _analysis(args),
        "sweep": lambda: _analysis(args),
        "ledger": lambda: _ledger(args.run_dir, args.redis),
    }
    if args.command in simple:
        return simple[args.command]()
    try:
        if args.command == "config" and args.action == "explain":
            from tidal.config import explain

            print(explain(args.key))
            return 0
        cfg = load_config(*_split(args))
        return _role(cfg, args)
    except (ConfigError, FileNotFoundError) as err:  # e.g. a preset whose model.path is still empty
        print(f"tidal {args.command}: {err}", file=sys.stderr)
        return 2


def _ledger(run_dir: str, redis_url: str | None) -> int:
    from tidal.learner.tools.ledger_check import main as check

    return check(run_dir, redis_url)


def entry() -> None:
    """The `tidal` command (and `python -m tidal`): `main` (quiet where its reader stops early,
    `main_to_a_pipe`), then out without tearing the interpreter down. With torch, transformers, vLLM
    or MLflow loaded, finalizing takes seconds (2.4 s for `tidal run` on a 2-core machine) and every
    role's work is done and written by then: MLflow runs ended, transports closed, child processes
    stopped. Logs and the standard streams are flushed first. An exception still unwinds and exits
    the usual way."""
    code = main_to_a_pipe()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


CLOSED_PIPE_EXIT = 128 + 13  # what a shell reports for a command that SIGPIPE ended, as `yes | head` does


def main_to_a_pipe(argv: list[str] | None = None) -> int:
    """`main`, whose output may go to a reader that stops early (`tidal presets | head -1`): the reader
    has what it wanted, so tidal stops quietly, exit 141, with no BrokenPipeError. A BrokenPipeError
    from anything else (a socket whose peer went away) is still raised."""
    try:
        code = main(argv)
        sys.stdout.flush()  # what is still buffered meets the closed pipe here, not at exit
        return code or 0
    except BrokenPipeError:
        closed = [stream for stream in (sys.stdout, sys.stderr) if _reader_gone(stream)]
        if not closed:
            raise
        for stream in closed:  # the flush at exit then has somewhere to go
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        return CLOSED_PIPE_EXIT


def _reader_gone(stream) -> bool:
    """Whether `stream` is a pipe or socket whose reading end is closed (poll says POLLERR or POLLHUP)."""
    import select

    try:
        poll = select.poll()
        poll.register(stream.fileno(), select.POLLOUT)
    except (AttributeError, OSError, ValueError):  # no file descriptor (a stream replaced in-process)
        return False
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))


def _role(cfg, args) -> int:
    from tidal.tasks import get_task

    if args.command == "config":
        return _config(cfg, args)
    get_task(cfg.task.name)  # an unknown or incomplete task is one line, before any process starts
    if args.command in ("learner", "actor"):
        cfg = _own_keys(cfg, args.command)
        _check_keys(cfg)
    if args.command == "actor":
        _check_actor_ports(cfg)
    if args.command == "run":
        from tidal.ops.launcher import launch

        return launch(cfg, resume=args.resume, print_samples=args.print_samples, overwrite=args.overwrite)
    if args.command == "learner":
        from tidal.learner.main import main as learner_main

        if args.print_samples:  # the learner's diagnostics read it (a pod sets it as an environment variable)
            os.environ["TIDAL_PRINT_SAMPLES"] = str(args.print_samples)

        return learner_main(cfg, resume=args.resume)
    if args.command == "actor":
        from tidal.actor.main import main as actor_main

        return actor_main(cfg)
    from tidal.config import resolve
    from tidal.learner.tools.warmstart import build_tiny
    from tidal.models import resolve_model_path

    cfg = resolve(cfg, model_path=resolve_model_path(cfg.model, cfg.task, build_tiny))
    if args.command == "plan-batch":
        return _plan_batch(cfg, args)
    print(cfg.model.path)
    return 0


def _own_keys(cfg, role: str):
    """An actor started on its own on loopback with no keys named takes its own from its run's folder,
    where the learner made them (learner.main makes them once it knows the folder is its own)."""
    from dataclasses import replace

    from tidal.config import BrokerType

    if role != "actor" or cfg.broker.type is not BrokerType.zmq:
        return cfg
    from tidal.broker.zmq_keys import own_keys

    z = own_keys(cfg.broker.zmq, cfg.run_dir, role, [cfg.actor.id or f"actor-{cfg.actor.index}"])
    return cfg if z is cfg.broker.zmq else replace(cfg, broker=replace(cfg.broker, zmq=z))


def _check_keys(cfg) -> None:
    """A role started on its own with CURVE on names its keys folder (`tidal run` makes keys of its own):
    one line naming broker.zmq.keys_dir, before any engine or model is built."""
    from tidal.config import BrokerType, curve_on

    if cfg.broker.type is BrokerType.zmq and curve_on(cfg.broker.zmq):
        from tidal.broker.zmq_keys import require_keys

        require_keys(cfg.broker.zmq.keys_dir, cfg.broker.zmq.host)


def _check_actor_ports(cfg) -> None:
    """An actor started on its own on ZeroMQ dials the learner's ports, which the launcher fills in for
    the actors it starts: without them it would fail once its engine was up."""
    from tidal.config import BrokerType, ConfigError

    z = cfg.broker.zmq
    missing = [k for k in ("control_port", "rollout_port", "weights_port") if not getattr(z, k)]
    if cfg.broker.type is BrokerType.zmq and missing:
        raise ConfigError(
            f"config key 'broker.zmq.{missing[0]}' = 0: an actor started on its own dials the "
            f"learner's ports; set {', '.join('broker.zmq.' + k for k in missing)} (the learner writes "
            "them to <run_dir>/endpoints.json)"
        )


def _config(cfg, args) -> int:
    """show: the resolved YAML (what a run's config.yaml would hold, before the launcher fills in
    the model path and run_dir); check: the memory plan first (it needs no data), then everything
    `tidal run` checks before it starts anything."""
    if args.action == "show":
        from tidal.config import redacted_config, to_yaml

        print(to_yaml(redacted_config(cfg)), end="")  # credentials in URIs shown as ***
        return 0
    from tidal.ops.memory import check_lines
    from tidal.ops.preflight import preflight
    from tidal.ops.reachable import check_reachable

    if args.model_config and not os.path.exists(args.model_config):
        raise ConfigError(
            f"--model-config {args.model_config}: no such file or folder (the model's config.json, or its folder)"
        )
    for line in check_lines(cfg, args.gpu_gib, args.gpus_per_node, args.host_gib, args.model_config):
        print(line)
    for line in preflight(cfg):
        print(line)
    for line in check_reachable(cfg):
        print(line)
    print("config ok")
    return 0


def _keys(folder: str, actors: str) -> int:
    from tidal.broker.zmq_keys import generate

    try:
        out = generate(folder, [a for a in actors.split(",") if a])
    except ValueError as err:  # an actor id that is not a plain name, a folder of another user's: nothing written
        print(f"tidal keys: {err}", file=sys.stderr)
        return 2
    print(
        f"{out}: give the learner {out}/learner.key_secret and actors/*.key; each actor learner.key "
        "and its own actors/<id>.key_secret"
    )
    return 0


def _health(path: str, max_age_s: float) -> int:
    import os
    import time

    try:
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        print(f"tidal health: {path} does not exist yet", file=sys.stderr)
        return 1
    if age > max_age_s:
        print(f"tidal health: {path} is {age:.0f} s old (> {max_age_s:.0f} s)", file=sys.stderr)
        return 1
    return 0


def _presets() -> int:
    """Each shipped preset with the first line of its header comment."""
    from tidal.config import presets

    for name, path in presets().items():
        first = next((line.lstrip("# ").strip() for line in path.read_text().splitlines() if line.startswith("#")), "")
        print(f"{name:28} {first}")
    return 0


def _export(args) -> int:
    from pathlib import Path

    from tidal.learner.tools.export import export_checkpoint

    try:
        if not (Path(args.run_dir) / "config.yaml").is_file():  # read first by the export: say what it is not
            raise ConfigError(f"no run folder at {args.run_dir} (no config.yaml there)")
        out = export_checkpoint(
            Path(args.run_dir), args.step, Path(args.out) if args.out else None, args.force, args.merge
        )
    except (ConfigError, OSError, ValueError) as err:  # OSError: a folder that cannot be made or read
        print(f"tidal export: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _analysis(args) -> int:
    """fit and sweep: user errors (bad CSV, degenerate curves, bad keys, a run id the store lacks) as one
    line, exit 2; a run of the grid that fails as one line naming its logs, exit 1."""
    import os
    from pathlib import Path

    from tidal.ops.sweep import SweepRunFailed, sweep
    from tidal.scaling import ScalingFitError

    try:
        from tidal.ops.scaling_report import Window, fit_csv, report

        window = Window(args.fit_fraction, args.skip_fraction)
        if args.command == "sweep":
            configs, overrides = _split(args)
            if args.seeds < 1:
                raise ValueError(f"--seeds {args.seeds}: runs per grid point, >= 1")
            return sweep(
                configs,
                overrides,
                Path(args.out) if args.out else None,
                args.compute_metric,
                window,
                args.target,
                args.seeds,
            )
        _check_fit_flags(args.predict, Path(args.out))
        if args.csv:
            return fit_csv(args.csv, args.predict, window, Path(args.out))
        uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not (uri and args.runs):
            raise ValueError("needs --csv FILE, or --runs RUN_ID ... (and --tracking-uri URI or MLFLOW_TRACKING_URI)")
        return report(
            uri,
            {r: r for r in args.runs},
            args.compute_metric,
            Path(args.out),
            window=window,
            predict=args.predict,
            target=args.target,
        )
    except (ScalingFitError, ConfigError, ValueError, OSError) as err:  # OSError: an --out that cannot be written
        print(f"tidal {args.command}: {err}", file=sys.stderr)
        return 2
    except SweepRunFailed as err:  # the run said why in its own lines, above; the sweep's parent run is FAILED
        print(f"tidal sweep: {err}", file=sys.stderr)
        return 1


def _check_fit_flags(predict: float | None, out) -> None:
    """What `tidal fit` can say is wrong with its flags before it reads or fits anything."""
    if predict is not None and not predict > 0:  # NaN too
        raise ValueError(f"--predict {predict:g}: the compute to predict the pass rate at must be > 0")
    if not out.parent.is_dir():
        raise ValueError(f"--out {out}: the folder {out.parent} does not exist")


def _plan_batch(cfg, args) -> int:
    """The earlier runs are read first: a mistyped run id or store is one line, exit 2, before minutes of
    probing."""
    import os
    import tempfile
    from pathlib import Path

    from tidal.ops.plan_batch import default_eval_groups, plan, plot_plan, print_plan, probe, run_evidence
    from tidal.scaling import ScalingFitError

    try:
        sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip().isdigit()})
        if not sizes or min(sizes) < 1 or len(sizes) != len(set(args.batch_sizes.split(","))):
            raise ValueError(
                f"--batch-sizes {args.batch_sizes}: prompt groups per step, whole numbers >= 1 "
                "separated by commas (4,8,16)"
            )
        if args.eval_every_groups is not None and args.eval_every_groups < 1:
            raise ValueError(f"--eval-every-groups {args.eval_every_groups}: a number of prompt groups, >= 1")
        _check_fit_flags(None, Path(args.out))
        uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if args.runs and not uri:
            raise ValueError("--runs needs --tracking-uri URI (or MLFLOW_TRACKING_URI): the store that holds them")
        evidence = run_evidence(uri, args.runs, args.target) if args.runs else []
    except (ScalingFitError, ValueError) as err:
        print(f"tidal plan-batch: {err}", file=sys.stderr)
        return 2
    configs, overrides = _split(args)
    eval_groups = args.eval_every_groups or default_eval_groups(cfg.learner, cfg.eval)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.probe_dir or tmp)
        try:
            probes = [probe(configs, overrides, b, folder) for b in sizes]
        except RuntimeError as err:
            print(f"tidal plan-batch: {err}", file=sys.stderr)
            return 1
    rows, note = plan(probes, evidence, cfg.sampling.n, eval_groups, cfg.staleness.max_lag)
    print_plan(rows, note)
    plot_plan(rows, Path(args.out))
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
