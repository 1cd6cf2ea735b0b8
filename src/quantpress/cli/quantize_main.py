"""``quantize``: quantization verbs. One verb per registered target verb of the command
``quantize`` (built from the targets' declarations, :mod:`quantpress.targets.registry`; every
verb and option: docs/commands.md), and:

  quantize eval BASE [OUTPUT ...] [--text FILE] [--ctx 512] [--json]
  quantize batch JOBS.toml -o OUT_ROOT [--dry-run] [--ray [ADDRESS]] [--device cpu] [--force] [--json]
"""
from __future__ import annotations

import json
from typing import NoReturn
from pathlib import Path

from quantpress.cli import common
from quantpress.convert.sources import REPO_HELP


def add_verbs(sub) -> None:
    """Add the ``quantize`` verbs to an argparse subparsers object: one per registered target
    verb (:func:`quantpress.cli.common.add_target_verbs`), then ``eval`` and ``batch``."""
    common.add_target_verbs(sub, "quantize")

    e = sub.add_parser("eval", help="perplexity and KL divergence against the base model "
                                    "(llama-perplexity conventions)")
    e.add_argument("base", help="base model: Hugging Face directory or GGUF file" + REPO_HELP)
    e.add_argument("outputs", nargs="*", help="models to compare with the base (GGUF files, HF, "
                                              "AWQ or EXL2 directories, or repo ids at their "
                                              "default branch)")
    common.add_model_source(e, "BASE")
    e.add_argument("--text", help="UTF-8 text file (default: held-out split of exllamav2's wiki.utf8)")
    e.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512; the second half is scored)")
    e.add_argument("--chunks", type=int, help="evaluate only the first N chunks")
    e.add_argument("--json", action="store_true", help="print the results as JSON")
    common.verb_options(e, _eval)

    b = sub.add_parser("batch", help="many outputs of many models from one TOML job file, sharing "
                                     "one load and one calibration pass per model; resumable")
    b.add_argument("jobs", help="job file (TOML: [defaults] and [[model]] entries)")
    b.add_argument("-o", "--output", required=True, help="OUT_ROOT: outputs go to OUT_ROOT/<name>/")
    b.add_argument("--dry-run", action="store_true",
                   help="check the job file and print the plan (outputs, estimated disk and memory)")
    b.add_argument("--force", action="store_true",
                   help="overwrite output paths that this batch did not make")
    b.add_argument("--json", action="store_true", help="print the closing table as JSON")
    b.add_argument("--device", default=None, help="override every model's device (auto, cpu, cuda, cuda:N)")
    b.add_argument("--allow-download", action="store_true",
                   help="fetch a repo-id source from the Hugging Face Hub when the local cache "
                        "lacks it (default: offline, the cache only)")
    b.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run the models as Ray tasks on the cluster at ADDRESS (or a local Ray "
                        "instance without one; one GPU per task where there are GPUs); OUT_ROOT "
                        "must be a path every node sees. Needs pip install 'quantpress[ray]'")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    common.add_debug(b)
    b.set_defaults(run=_batch)


def _eval(args) -> int:
    from quantpress.targets.eval import EvalOptions, evaluate

    base = common.model_path(args, args.base)
    outputs = [common.model_path(args, o, revision=False) for o in args.outputs]
    r = evaluate(base, outputs, EvalOptions(args.text, args.ctx, args.chunks),
                 common.compute_options(args), progress=not args.quiet)
    print(json.dumps(r.to_json(), indent=1) if args.json else r.text_table())
    return 0


def _batch(args) -> int:
    from quantpress.batch import jobfile, runner

    jobs = jobfile.read_jobs(args.jobs, args.output, device=args.device,
                             allow_download=args.allow_download)
    if args.ray is not None:
        from quantpress.batch import ray_exec

        ray_exec.check_ray()
    plans = [runner.plan_model(j, Path(args.output), args.force) for j in jobs]
    if args.dry_run:
        print(runner.plan_text(plans))
        return 0
    Path(args.output).mkdir(parents=True, exist_ok=True)
    bar = None
    if not args.quiet:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(len(j.outputs) for j in jobs), desc="batch", unit="output", position=0)

    def on_row(r):
        if bar is not None:
            bar.set_postfix_str(f"{r.model}: {r.path} {r.status}")
            bar.update(1)

    if args.ray is not None:
        rows = ray_exec.run_batch_ray(plans, None if args.ray == "local" else args.ray, on_row=on_row)
    else:
        from quantpress.batch import lanes

        rows = runner.run_plans(plans, progress=not args.quiet, on_row=on_row, side_lane=lanes.SideLane)
    if bar is not None:
        bar.close()
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=1))
    else:
        print(runner.closing_table(rows))
    return runner.exit_code(rows)


def main(argv: list[str] | None = None) -> int:
    """``quantize`` entry point; returns the exit code (0, 1, 2 or 3)."""
    return common.main("quantize", "quantpress quantization", add_verbs, argv)


def console() -> NoReturn:
    """The ``quantize`` command (console script): :func:`main` on ``sys.argv``, then
    :func:`~quantpress.cli.common.exit_with` its code."""
    common.exit_with(main())


if __name__ == "__main__":
    console()
