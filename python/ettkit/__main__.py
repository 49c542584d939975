"""Command line: ``python -m ettkit report RUN_DIR [options]`` (also installed as ``ettkit``).

Exit status: 0 on success, 2 for a usage error or a run directory that cannot be reported on, and 141
(128 + SIGPIPE, what a C tool killed by SIGPIPE reports) when the reader of the output went away early, as
``python -m ettkit report RUN | head`` does: then nothing is printed to stderr either.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

#: The exit status when stdout's reader closed the pipe early (128 + SIGPIPE).
EXIT_BROKEN_PIPE = 141


def _report(args: argparse.Namespace) -> int:
    from . import errors
    from .ett import build_report, format_report
    from .ett.table import shown  # every path and ledger value printed goes through it (docs/security.md)

    if args.plot_with and not args.plot:
        print("ettkit report: error: --plot-with needs --plot FILE.png (the picture both runs are drawn in)",
              file=sys.stderr)
        return 2
    try:
        # The trace is streamed by the C++ report while it is built; only the plot needs the timelines here.
        report = build_report(args.run_dir, include_initial_queue=args.include_initial_queue,
                              mtbf_prior_s=args.mtbf_prior, method=args.method,
                              include_timeline=bool(args.plot), trace_path=args.trace)
    except (errors.Error, OSError) as e:
        print(f"ettkit report: error: {shown(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a run directory is outside input: one line, never a traceback
        print(f"ettkit report: error: {shown(args.run_dir)}: {type(e).__name__}: {shown(e)}", file=sys.stderr)
        return 2
    if args.prometheus:
        from .ett.prometheus import write_prometheus

        write_prometheus(report, args.prometheus, job=args.job)
    if args.plot:
        from .ett.plot import write_plot

        others = []
        for other in args.plot_with or []:
            try:
                others.append(build_report(other, include_initial_queue=args.include_initial_queue,
                                           mtbf_prior_s=args.mtbf_prior, method=args.method, include_timeline=True))
            except (errors.Error, OSError) as e:
                print(f"ettkit report: error: --plot-with {shown(other)}: {shown(e)}", file=sys.stderr)
                return 2
            except Exception as e:  # noqa: BLE001 - outside input as RUN_DIR is: one line, no traceback
                print(f"ettkit report: error: --plot-with {shown(other)}: {type(e).__name__}: {shown(e)}",
                      file=sys.stderr)
                return 2
        write_plot([report, *others], args.plot)
    if args.tensorboard:
        from .ett.tensorboard import write_tensorboard

        write_tensorboard(report, args.tensorboard)
    if args.json:
        report.pop("timeline", None)
        report.pop("job_timeline", None)
        report.pop("background", None)
        json.dump(report, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        print(format_report(report))
    if args.serve is not None:
        from .ett.live import serve_command

        sys.stdout.flush()
        return serve_command(argparse.Namespace(run_dir=args.run_dir, port=args.serve, host=args.serve_host,
                                                job=args.job))
    return 0


def _fleet(args: argparse.Namespace) -> int:
    """``ettkit fleet``: exit 0 when at least one job was read (unreadable ones are listed), 2 when none was."""
    from . import errors
    from .ett.fleet import find_run_dirs, fleet_report, format_fleet, write_fleet_plot
    from .ett.table import shown

    if args.top < 1:
        print(f"ettkit fleet: error: --top {args.top} must be at least 1", file=sys.stderr)
        return 2
    try:
        fleet = fleet_report(find_run_dirs(args.dirs, args.glob), include_initial_queue=args.include_initial_queue)
    except (errors.Error, OSError) as e:
        print(f"ettkit fleet: error: {shown(e)}", file=sys.stderr)
        return 2
    if args.plot and fleet["jobs_read"]:
        try:
            write_fleet_plot(fleet, args.plot)
        except OSError as e:
            print(f"ettkit fleet: error: --plot {shown(args.plot)}: {shown(e)}", file=sys.stderr)
            return 2
    if args.json:
        json.dump(fleet, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        print(format_fleet(fleet, top=args.top), end="")
    if not fleet["jobs_read"]:
        print(f"ettkit fleet: error: none of the {fleet['jobs_total']} run directories could be read "
              "(reasons above)" + (", so no plot was written" if args.plot else ""), file=sys.stderr)
        return 2
    return 0


def _project(args: argparse.Namespace) -> int:
    """``ettkit project``: exit 0, or 2 when the run cannot be reported or an argument is out of range."""
    from . import errors
    from .ett import build_report
    from .ett.projection import format_projection, project
    from .ett.table import shown

    try:
        report = build_report(args.run_dir, include_timeline=False)
        p = project(report, days=args.days, failures_per_day=args.failures_per_day, mtbf_h=args.mtbf_hours,
                    failures_per_1000_per_day=args.failures_per_1000_per_day, world_size=args.world_size)
    except (errors.Error, OSError, ValueError) as e:
        print(f"ettkit project: error: {shown(e)}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(p, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        print(format_projection(p, args.run_dir), end="")
    return 0


def _export(args: argparse.Namespace) -> int:
    """``ettkit export``: exit 0 once the directory is written, 2 for a step or argument that cannot be."""
    from . import errors
    from .ett.table import shown
    from .integrations.hf_export import export_hf

    try:
        r = export_hf(args.step_dir, args.out_dir, strip_prefix=args.strip_prefix, add_prefix=args.add_prefix,
                      max_shard_size=args.max_shard_size, config=args.config,
                      tied={} if args.no_tie else None, overwrite=args.overwrite)
    except (errors.Error, OSError) as e:
        print(f"ettkit export: error: {shown(e)}", file=sys.stderr)
        return 2
    tied = "".join(f", {a} tied to {b}" for a, b in r.tied.items())
    print(f"ettkit export: {len(r.weight_map)} tensors, {r.total_bytes} bytes from {shown(r.step_dir)} into "
          f"{shown(r.out_dir)} ({', '.join(r.files)}{tied}), {r.bytes_verified} bytes verified, {r.seconds:.2f} s")
    return 0


def _export_arguments(ex: argparse.ArgumentParser) -> None:
    """The arguments of ``ettkit export``."""
    ex.add_argument("step_dir", help="a step directory (CKPT/step-<N>), or a checkpoint directory: its newest step")
    ex.add_argument("out_dir", help="the model directory to write (from_pretrained(OUT_DIR) loads it)")
    ex.add_argument("--format", required=True, choices=["hf"], help="hf: model.safetensors (+ index when sharded)")
    ex.add_argument("--config", metavar="CONFIG.json", help="the model's config.json, copied into OUT_DIR")
    ex.add_argument("--strip-prefix", default="model.", metavar="PREFIX",
                    help="export the tensors under PREFIX, PREFIX removed (default 'model.'; '' for all)")
    ex.add_argument("--add-prefix", default="", metavar="PREFIX", help="put PREFIX before every exported name")
    ex.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                    help="split into model-0000k-of-0000n.safetensors past SIZE (default 5GB; e.g. 500MB, 512MiB)")
    ex.add_argument("--no-tie", action="store_true",
                    help="write tied weights (lm_head.weight) too, not once (default: once when the config ties)")
    ex.add_argument("--overwrite", action="store_true", help="replace model files an earlier export left in OUT_DIR")


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status (see the module docstring)."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # inside the try: a closed pipe shows up at the latest here
        return status
    except BrokenPipeError:
        # The reader (`head`, a pager) has what it wanted. Python would flush stdout again at exit and
        # print a second error: point stdout at /dev/null first (the recipe of Python's signal docs).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def _precompile_arguments(p: argparse.ArgumentParser) -> None:
    """`ettkit precompile`'s options (ettkit.startup.precompile_job runs it)."""
    p.add_argument("--model", required=True, metavar="MODULE:NAME",
                   help="the trainer's model factory (called without arguments) or module object")
    p.add_argument("--spec", required=True, metavar="MODULE:NAME",
                   help="the trainer's BatchSpec, or a function returning it")
    p.add_argument("--shared-dir", required=True, help="the shared compile cache (CompileCache(shared_dir=...))")
    p.add_argument("--cache-dir", help="this run's own cache directory (default: a temporary one)")
    p.add_argument("--config", metavar="JSON", help="CompileCache(config=...) as the trainer passes it")
    p.add_argument("--compile-kwargs", metavar="JSON", help="overlapped_start(compile_kwargs=...) as the trainer's")
    p.add_argument("--forward", metavar="MODULE:NAME", help="overlapped_start(forward=...) as the trainer's")
    p.add_argument("--seed", type=int, default=0, help="overlapped_start(seed=...) as the trainer's (default 0)")
    p.add_argument("--device", help="move the model there first (default: where the factory left it)")
    p.add_argument("--job", help="this run's name in the file (default $SLURM_JOB_ID or $TORCHELASTIC_RUN_ID)")
    p.add_argument("--run-dir", help="write this run's ETT ledger there (its compile time then counts)")


def _main(argv: list[str] | None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(prog="ettkit", description="ettkit command line")
    parser.add_argument("--version", action="version", version=f"ettkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="the ETT report of a run directory (a pure function of its ledger)")
    rep.add_argument("run_dir", help="the directory given to ettkit.ett.Recorder (holds ett/rank-<r>.jsonl)")
    rep.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    rep.add_argument("--trace", metavar="FILE", help="write a Chrome trace (open in Perfetto / chrome://tracing)")
    rep.add_argument("--prometheus", metavar="FILE", help="write the Prometheus text exposition format")
    rep.add_argument("--job", help="job label for the Prometheus metrics")
    rep.add_argument("--plot", metavar="FILE.png",
                     help="write a per-rank timeline, coloured by phase, above where the job's time went")
    rep.add_argument("--plot-with", metavar="RUN_DIR", action="append",
                     help="also draw this run in the plot, under RUN_DIR, on the same time axis (repeatable)")
    rep.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard scalars into DIR")
    rep.add_argument("--include-initial-queue", action="store_true",
                     help="count attempt 0's scheduling (queue) time in E2E")
    rep.add_argument("--mtbf-prior", type=float, default=0.0, metavar="SECONDS",
                     help="MTBF to assume when the ledger shows no failure")
    rep.add_argument("--method", default="young", choices=["young", "daly", "daly_series", "daly_exact"],
                     help="checkpoint-interval formula of the recommendation")
    rep.add_argument("--serve", type=int, metavar="PORT",
                     help="then keep serving the run's live ETT figures on PORT until SIGINT/SIGTERM (as `serve`)")
    rep.add_argument("--serve-host", default="127.0.0.1", metavar="HOST",
                     help="address --serve listens on (default 127.0.0.1; 0.0.0.0 for every interface)")
    fl = sub.add_parser("fleet", help="ETT over many run directories, weighted by accelerator-hours")
    fl.add_argument("dirs", nargs="+", metavar="DIR",
                    help="run directories (with --glob: parent directories whose matching sub-directories are runs)")
    fl.add_argument("--glob", metavar="PATTERN", help="take the sub-directories of each DIR matching PATTERN")
    fl.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    fl.add_argument("--plot", metavar="FILE.png", help="write stacked bars per job and for the fleet")
    fl.add_argument("--top", type=int, default=5, metavar="N", help="causes listed per bucket in the table")
    fl.add_argument("--include-initial-queue", action="store_true",
                    help="count each job's attempt-0 scheduling (queue) time in its E2E")
    pr = sub.add_parser("project", help="projected ETT%% of a long job from a measured run's costs")
    pr.add_argument("run_dir", help="the measured run (its ett/rank-<r>.jsonl ledgers)")
    pr.add_argument("--days", type=float, default=30.0, help="wall-clock length of the projected job (default 30)")
    rate = pr.add_mutually_exclusive_group(required=True)
    rate.add_argument("--failures-per-day", type=float, metavar="N", help="the job's failures per day")
    rate.add_argument("--mtbf-hours", type=float, metavar="H", help="the job's mean time between failures")
    rate.add_argument("--failures-per-1000-per-day", type=float, metavar="N",
                      help="failures per 1,000 devices per day (the job's rate scales with --world-size)")
    pr.add_argument("--world-size", type=int, metavar="N", help="devices of the projected job (default: the run's)")
    pr.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    srv = sub.add_parser("serve", help="serve the run's live ETT figures over HTTP, in the Prometheus format")
    srv.add_argument("run_dir", help="the directory given to ettkit.ett.Recorder (holds ett/rank-<r>.jsonl)")
    srv.add_argument("--port", type=int, required=True, help="TCP port to listen on (0: any free port, printed)")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    srv.add_argument("--job", help="job label for every metric")
    pre = sub.add_parser("precompile", help="fill a shared compile cache ahead of a job (docs/startup.md)",
                         description="Precompiles the trainer's model for its batch spec into a shared compile "
                         "cache (CompileCache(shared_dir=...)), so that the jobs of that model start without "
                         "compiling. Needs $ETTKIT_COMPILE_CACHE_SECRET.")
    _precompile_arguments(pre)
    _export_arguments(sub.add_parser("export", help="a committed step as a Hugging Face model directory "
                                                    "(docs/integrations.md)"))
    args = parser.parse_args(argv)
    if args.command == "precompile":
        from .startup import precompile_job  # imports torch: only for this command

        return precompile_job.command(args)
    if args.command == "serve":
        from .ett.live import serve_command

        return serve_command(args)
    if args.command == "report":
        return _report(args)
    if args.command == "fleet":
        return _fleet(args)
    if args.command == "project":
        return _project(args)
    if args.command == "export":
        return _export(args)
    return 2  # unreachable: argparse requires a command


if __name__ == "__main__":
    sys.exit(main())
