"""``python -m agl.study [STUDY] [--out DIR] [--seeds 0,1,2] [--only A,B] [--report-only]
[key=value ...]``: run a study's settings over its seeds, then write its report.

``STUDY`` is ``conf/study/NAME.yaml``'s name (default: ``strategies``) or a yaml path;
``key=value`` overrides go to every run after the study's own (``trainer.steps=10``).
The runs land in ``DIR/<setting>/seed-<seed>/`` (default ``runs/study/<name>``); a
finished run is not run again, so the command resumes a stopped study. The report
(``DIR/report/``: summary.md, index.html, a PNG per metric) is written at the end and
after every run, so it can be read while the study goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from agl.core.user_error import UserError
from agl.study.report import build
from agl.study.runner import RunResult, run_study
from agl.study.spec import load_study


def _ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None


def _names(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agl.study",
        description="Run a study (settings x seeds of python -m agl.train) and report it.",
    )
    parser.add_argument(
        "study", nargs="?", default="strategies", help="a conf/study name or a yaml path"
    )
    parser.add_argument("overrides", nargs="*", help="key=value, passed to every run")
    parser.add_argument("--out", type=Path, help="the study's folder (default runs/study/NAME)")
    parser.add_argument("--report", type=Path, help="where the report goes (default OUT/report)")
    parser.add_argument("--seeds", type=_ints, help="these seeds instead of the study's")
    parser.add_argument("--only", type=_names, help="only these settings (comma-separated)")
    parser.add_argument("--report-only", action="store_true", help="run nothing, write the report")
    args = parser.parse_intermixed_args(argv)  # overrides before or after the options
    logging.basicConfig(level=logging.WARNING, format="agl.study: %(message)s")
    # A study name given as the first override-looking word is an override, not a study.
    if "=" in args.study:
        args.overrides.insert(0, args.study)
        args.study = "strategies"
    try:
        declared = load_study(args.study)
        study = declared
        if args.seeds:
            study = dataclasses.replace(declared, seeds=args.seeds)
        # The report covers the whole study: what --seeds adds, and what it had already.
        reported = dataclasses.replace(declared, seeds=sorted({*declared.seeds, *study.seeds}))
        unknown = sorted(set(args.only or ()) - set(study.settings))
        if unknown:
            raise UserError(f"no setting {', '.join(unknown)} in study {study.name}")
    except UserError as error:
        sys.stderr.write(f"agl.study: {error}\n")
        return 2
    out = args.out or Path("runs") / "study" / study.name
    report = args.report or out / "report"

    def on_run(number: int, total: int, result: RunResult) -> None:
        sys.stderr.write(
            f"agl.study: [{number}/{total}] {result.setting} seed {result.seed}: {result.status}"
            + (f" in {result.seconds:.0f} s" if result.status != "skipped" else "")
            + "\n"
        )
        build(reported, out, report)

    failed = []
    try:
        if not args.report_only:
            results = run_study(study, out, args.overrides, args.only, on_run)
            failed = [r for r in results if r.status == "failed"]
        written = build(reported, out, report)
    except UserError as error:  # a malformed metrics line, a value past its bounds
        sys.stderr.write(f"agl.study: {error}\n")
        return 2
    if written is None:
        sys.stderr.write(f"agl.study: no finished run under {out}: no report\n")
        return 1
    print(f"report: {written}")
    for r in failed:
        sys.stderr.write(
            f"agl.study: failed: {r.setting} seed {r.seed} ({r.folder / 'stderr.log'})\n"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
