"""Show a pipeline schedule without starting processes:

    python -m nanocolossal.pipeline --show --stages 4 --microbatches 8 [--chunks 2]
                                    [--schedule 1f1b|gpipe|interleaved|zero_bubble|zbv]

Prints a schedule's timeline (one row per rank) and its bubble, and checks the plan by simulating
it. No processes are started.
"""
import argparse
import sys

from .plan import SCHEDULES, all_plans
from .simulate import render, simulate
from .steps import PlanError, v_shaped


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanocolossal.pipeline",
                                     description=__doc__.splitlines()[2])
    parser.add_argument("--show", action="store_true",
                        help="print the timeline (the default action)")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=None,
                        help="default: 8, or 2 x stages - 1 for zbv where that is more")
    parser.add_argument("--chunks", type=int, default=None, help="default: 2 for zbv, else 1")
    parser.add_argument("--schedule", choices=list(SCHEDULES), default=None,
                        help="default: interleaved when --chunks > 1, else 1f1b")
    args = parser.parse_args(argv)
    chunks = args.chunks or (2 if args.schedule == "zbv" else 1)
    schedule = args.schedule or ("interleaved" if chunks > 1 else "1f1b")
    if args.microbatches is None:  # zbv needs M >= 2P - 1 (plan.check_sizes)
        args.microbatches = max(8, 2 * args.stages - 1) if schedule == "zbv" else 8
    try:
        print(render(schedule, args.stages, args.microbatches, chunks))
        held = simulate(all_plans(schedule, args.stages, args.microbatches, chunks),
                        args.stages, chunks, v_shaped(schedule))["max_in_flight"]
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    peaks = ", ".join(f"rank {r}: {n}" for r, n in enumerate(held))
    print(f"micro-batches in flight per rank (peak): {peaks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
