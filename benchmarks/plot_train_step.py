"""The MLP training step by model size: runs train_step.py for several widths.

    python benchmarks/plot_train_step.py [--steps 15] [--widths 256 512 1024 2048 3072]
                                         [--out docs/benchmarks]

Each width is one job of benchmarks/train_step.py on --ranks ranks (2 by
default), started with mpitrainrun with this Python, keeping depth and batch;
the jobs write their figures with --json. Writes, in --out:
  train_step.md   a row per width: parameters, then each mode's time per step
                  and the step-wise ratios, every figure a median with its
                  range (min-max) over the job's steps;
  train_step.png  time per step against parameter count, a line per mode,
                  bars spanning each mode's range.
A job that fails (mpitrain's parameters differ from DDP's, say) stops the
script with its exit status, before anything is written.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# Mode and ratio names as train_step.py writes them in its --json file.
MODES = ("none", "ddp", "mpitrain", "mpitrain, bf16 on the wire")
RATIOS = ("mpitrain / none", "mpitrain / ddp", "mpitrain, bf16 on the wire / none",
          "mpitrain, bf16 on the wire / ddp")


def launcher():
    """mpitrainrun beside this Python (its virtual environment), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpitrainrun")
    return beside if os.path.exists(beside) else shutil.which("mpitrainrun") or "mpitrainrun"


def run_train_step(width, args, json_path):
    """One train_step.py job; returns its --json figures."""
    command = [launcher(), "-np", str(args.ranks), sys.executable,
               os.path.join(HERE, "train_step.py"), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--width", str(width),
               "--depth", str(args.depth), "--json", json_path]
    print("+ " + " ".join(command), flush=True)
    job = subprocess.run(command)
    if job.returncode != 0:
        raise SystemExit(f"train_step.py with --width {width} failed "
                         f"(exit status {job.returncode})")
    with open(json_path) as stream:
        return json.load(stream)


def cell(stats, digits):
    return (f"{stats['median']:.{digits}f} "
            f"({stats['min']:.{digits}f}-{stats['max']:.{digits}f})")


def table(results, command):
    first = results[0]
    lines = [
        "# The MLP training step by model size", "",
        f"Produced by `{command}`.", "",
        f"MLP {first['depth']} hidden layers of the width below, batch {first['batch']} "
        f"per rank, {first['ranks']} ranks with 1 thread each, {first['steps']} timed "
        "steps per mode after a warm-up, the modes taking turns step after step; times "
        "of the slowest rank. Every figure is the median over the steps with its range "
        "(min-max); ratios are taken step by step, then summarised the same way. "
        "The overlap column is the choice mpitrain made (DistributedOptimizer's "
        "overlap=None); the bf16 mode makes the same one.", "",
        "| width | parameters | " + " | ".join(f"{mode}, ms" for mode in MODES)
        + " | " + " | ".join(RATIOS) + " | overlap |",
        "|---" * (3 + len(MODES) + len(RATIOS)) + "|"]
    for result in results:
        cells = ([str(result["width"]), f"{result['parameters'] / 1e6:.2f}M"]
                 + [cell(result["milliseconds"][mode], 1) for mode in MODES]
                 + [cell(result["ratios"][ratio], 2) for ratio in RATIOS]
                 + [str(result["overlap"])])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results, path):
    try:
        import matplotlib
    except ImportError:       # not among mpitrain's dependencies
        print(f"no {path}: matplotlib is not installed (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker
    parameters = [result["parameters"] for result in results]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for mode in MODES:
        stats = [result["milliseconds"][mode] for result in results]
        medians = [s["median"] for s in stats]
        spread = [[m - s["min"] for m, s in zip(medians, stats)],
                  [s["max"] - m for m, s in zip(medians, stats)]]
        axes.errorbar(parameters, medians, yerr=spread, marker="o", capsize=3, label=mode)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xticks(parameters, [f"{count / 1e6:.2g}M" for count in parameters])
    axes.xaxis.set_minor_locator(ticker.NullLocator())
    axes.yaxis.set_major_locator(ticker.LogLocator(subs=(1, 2, 5)))
    axes.yaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    axes.yaxis.set_minor_formatter(ticker.NullFormatter())
    axes.set_xlabel("parameters")
    axes.set_ylabel("time per step, ms (median, bars: min-max)")
    axes.set_title(f"MLP training step on {results[0]['ranks']} ranks")
    axes.grid(alpha=0.3, which="both")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 512, 1024, 2048, 3072])
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per mode and width")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, os.pardir, "docs", "benchmarks"),
                        help="directory for train_step.md and train_step.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        results = [run_train_step(width, args, os.path.join(scratch, f"{width}.json"))
                   for width in args.widths]
    results.sort(key=lambda result: result["parameters"])
    os.makedirs(args.out, exist_ok=True)
    command = (".venv/bin/python benchmarks/plot_train_step.py --widths "
               + " ".join(map(str, args.widths))
               + f" --depth {args.depth} --steps {args.steps} --warmup {args.warmup}"
               + f" --ranks {args.ranks}")
    with open(os.path.join(args.out, "train_step.md"), "w") as stream:
        stream.write(table(results, command))
    plot(results, os.path.join(args.out, "train_step.png"))
    print(f"wrote {os.path.join(args.out, 'train_step.md')} and train_step.png")


if __name__ == "__main__":
    main()
