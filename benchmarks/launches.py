"""The allreduce targets over several launches: what one launch cannot show.

    python benchmarks/launches.py [--launches 5] [--ranks 2] [--repetitions 9]
                                  [--sets resnet50 bert gpt2 geometric] [--out docs/benchmarks]

Some costs are decided once per launch (where memory lands, how threads
are placed), so a launch's repetitions agree with each other and still say
nothing of the next launch. This runs benchmarks/allreduce.py's targets
(--no-sweep) as --launches separate mpitrainrun jobs, one after the other,
and reports, per set and call form, each launch's median time and median
ratio to the raw call, the median over launches and the spread (the
lowest and highest launch median), with the load average at each launch's
end. With --out, writes allreduce_launches.md there.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from plot_train_step import launcher

HERE = os.path.dirname(os.path.abspath(__file__))


def run_launch(args, json_path):
    command = [launcher(), "-np", str(args.ranks), sys.executable,
               os.path.join(HERE, "allreduce.py"), "--no-sweep", "--idle-seconds", "0",
               "--memory-steps", "10", "--repetitions", str(args.repetitions),
               "--sets", *args.sets, "--json", json_path]
    print("+ " + " ".join(command), flush=True)
    job = subprocess.run(command, stdout=subprocess.DEVNULL)
    if job.returncode != 0:
        raise SystemExit(f"allreduce.py failed (exit status {job.returncode})")
    with open(json_path) as stream:
        return json.load(stream)


def per_launch(launches):
    """{(case, call, baseline): [(median ms, median ratio) per launch]}."""
    table = {}
    for launch in launches:
        for row in launch["rows"]:
            ratios = [ours / theirs for ours, theirs in zip(row["mpitrain"], row["raw"])]
            table.setdefault((row["case"], row["call"], row["baseline"]), []).append(
                (statistics.median(row["mpitrain"]) * 1e3, statistics.median(ratios)))
    return table


def report(launches, args):
    loads = ", ".join(f"{launch['load']:.1f}" for launch in launches)
    lines = [f"{len(launches)} launches of `allreduce.py --no-sweep --repetitions "
             f"{args.repetitions}` on {args.ranks} ranks ({os.cpu_count()} cores), one "
             f"after the other; load average at each launch's end: {loads}.", "",
             "Each launch gives its median over repetitions; the table gives those "
             "medians launch by launch, their median and their spread (lowest-highest).",
             "", "| case | call | per launch: mpitrain ms (/ raw) | mpitrain / raw, median "
             "of launches | spread over launches |", "|---|---|---|---|---|"]
    for (case, call, baseline), values in per_launch(launches).items():
        cells = ", ".join(f"{ms:.1f} ({ratio:.2f}x)" for ms, ratio in values)
        ratios = [ratio for _, ratio in values]
        lines.append(f"| {case}; raw: {baseline} | {call} | {cells} "
                     f"| {statistics.median(ratios):.2f}x "
                     f"| {min(ratios):.2f}-{max(ratios):.2f}x |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--launches", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repetitions", type=int, default=9)
    parser.add_argument("--sets", nargs="+", default=["resnet50", "bert", "gpt2",
                                                      "geometric"])
    parser.add_argument("--out", help="directory for allreduce_launches.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        launches = [run_launch(args, os.path.join(scratch, f"{index}.json"))
                    for index in range(args.launches)]
    text = report(launches, args)
    print(text)
    if args.out:
        command = (f".venv/bin/python benchmarks/launches.py --launches {args.launches} "
                   f"--ranks {args.ranks} --repetitions {args.repetitions} --sets "
                   + " ".join(args.sets) + f" --out {args.out}")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "allreduce_launches.md"), "w") as stream:
            stream.write(f"# Allreduce over several launches\n\nProduced by `{command}`."
                         f"\n\n{text}\n")


if __name__ == "__main__":
    main()
