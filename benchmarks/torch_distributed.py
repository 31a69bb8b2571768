"""PyTorch's own tools over the "mpitrain" backend against the same over gloo.

    python benchmarks/torch_distributed.py [--launches 3] [--ranks 2]
           [--repetitions 5] [--models resnet50 bert] [--json PATH]

Each launch is one mpitrainrun job of --ranks ranks that builds both
backends' groups in the same processes (mpitrain's the default group, gloo's
a group of every rank on the same store) and measures, case after case:

  ddp <model>:   one DDP step (forward, backward with its bucketed
                 allreduces, SGD step) of a model with the parameter shapes
                 of benchmarks/models.py's resnet50 or bert, and a cheap
                 forward (each parameter times the input, summed), so that
                 the gradients' communication is most of the step;
  fsdp <model>:  one FSDP2 step (fully_shard of the whole model: parameters
                 all-gathered, gradients reduce-scattered) of the same model;
  all_reduce 64 MiB:  dist.all_reduce of 16M float32 values.

Within a case the two backends take turns, repetition after repetition,
and each repetition's ratio (mpitrain's time / gloo's, each the slowest
rank's) is taken within that turn. A launch reports each case's median
ratio and the range of its repetitions; the summary gives, per case, every
launch's median, the median over launches and their range (the lowest and
highest launch median). The issue's goals: DDP and FSDP steps <= 0.8,
all_reduce <= 0.5.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GOALS = {"ddp": 0.8, "fsdp": 0.8, "all_reduce": 0.5}


def launcher():
    """mpitrainrun beside this Python (its virtual environment), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpitrainrun")
    return beside if os.path.exists(beside) else "mpitrainrun"


# -- inside a launch


def shaped_model(name):
    """Parameters shaped as model ``name``'s, and a forward that is only a sum."""
    import torch
    from models import parameter_shapes

    class Shaped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.weights = torch.nn.ParameterList(
                torch.nn.Parameter(torch.randn(shape) * 0.01)
                for shape in parameter_shapes(name))

        def forward(self, x):
            return sum((p * x).sum() for p in self.weights)
    return Shaped()


def slowest(seconds, gloo):
    """The slowest rank's time (a gloo all_reduce, outside the timed part)."""
    import torch
    import torch.distributed as dist
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=gloo)
    return value.item()


def timed(step, gloo):
    import torch.distributed as dist
    dist.barrier(group=gloo)
    started = time.perf_counter()
    step()
    return slowest(time.perf_counter() - started, gloo)


def training_step(model, optimizer):
    import torch

    def step():
        optimizer.zero_grad(set_to_none=False)
        model(torch.tensor(1.0)).backward()
        optimizer.step()
    return step


def ddp_steps(name, groups):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    steps = {}
    for backend, group in groups.items():
        model = DDP(shaped_model(name), process_group=group, gradient_as_bucket_view=True)
        steps[backend] = training_step(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    return steps


def fsdp_steps(name, groups):
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    steps = {}
    for backend, group in groups.items():
        model = fully_shard(shaped_model(name), mesh=DeviceMesh.from_group(group, "cpu"))
        steps[backend] = training_step(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    return steps


def all_reduce_steps(groups):
    import torch
    import torch.distributed as dist
    data = torch.ones(16 << 20)
    return {backend: (lambda group=group: dist.all_reduce(data, group=group))
            for backend, group in groups.items()}


def measure(steps, repetitions, gloo):
    """Per repetition, each backend's time in turn; returns times and ratios."""
    for step in steps.values():                 # warm-up: buckets, buffers, imports
        step()
    times = {backend: [] for backend in steps}
    for _ in range(repetitions):
        for backend, step in steps.items():
            times[backend].append(timed(step, gloo))
    ratios = [m / g for m, g in zip(times["mpitrain"], times["gloo"])]
    return {"times": times, "ratios": ratios}


def run_launch(args):
    import gc

    import torch
    import torch.distributed as dist
    import mpitrain.torch  # noqa: F401  (registers the backend)
    torch.set_num_threads(1)
    dist.init_process_group("mpitrain")
    gloo = dist.new_group(backend="gloo")
    groups = {"mpitrain": dist.group.WORLD, "gloo": gloo}
    cases = {}
    for name in args.models:
        for kind, build in (("ddp", ddp_steps), ("fsdp", fsdp_steps)):
            cases[f"{kind} {name}"] = measure(build(name, groups), args.repetitions, gloo)
            gc.collect()
    cases["all_reduce 64 MiB"] = measure(all_reduce_steps(groups), args.repetitions, gloo)
    if dist.get_rank() == 0:
        with open(args.json, "w") as stream:
            json.dump({"cases": cases, "load": os.getloadavg()[0]}, stream)
    dist.destroy_process_group()


# -- the launches and the summary


def launch(args, json_path):
    command = [launcher(), "-np", str(args.ranks), sys.executable, os.path.abspath(__file__),
               "--in-launch", "--repetitions", str(args.repetitions),
               "--models", *args.models, "--json", json_path]
    print("+ " + " ".join(command), flush=True)
    if subprocess.run(command, stdout=subprocess.DEVNULL).returncode != 0:
        raise SystemExit("a launch failed")
    with open(json_path) as stream:
        return json.load(stream)


def report(launches):
    print(f"\nmpitrain / gloo, time of one step on the slowest rank "
          f"({len(launches)} launches; per launch: median [range of repetitions])")
    summary = {}
    for case in launches[0]["cases"]:
        medians = [statistics.median(l["cases"][case]["ratios"]) for l in launches]
        goal = GOALS[case.split()[0]]
        per_launch = "  ".join(
            f"{statistics.median(r):.2f} [{min(r):.2f}-{max(r):.2f}]"
            for r in (l["cases"][case]["ratios"] for l in launches))
        gloo = statistics.median(t for l in launches for t in l["cases"][case]["times"]["gloo"])
        print(f"  {case:20s} median {statistics.median(medians):.2f}, launches "
              f"{min(medians):.2f}-{max(medians):.2f} (goal <= {goal}; gloo {gloo * 1e3:.0f} ms)"
              f"\n      {per_launch}")
        summary[case] = {"medians": medians, "goal": goal, "gloo_seconds": gloo}
    print("  load average at each launch's end: "
          + ", ".join(f"{l['load']:.1f}" for l in launches))
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=["resnet50", "bert"],
                        choices=("resnet50", "bert", "gpt2"))
    parser.add_argument("--json", help="file for the ratios")
    parser.add_argument("--in-launch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_launch:
        sys.path.insert(0, HERE)
        return run_launch(args)
    with tempfile.TemporaryDirectory() as directory:
        launches = [launch(args, os.path.join(directory, f"launch{i}.json"))
                    for i in range(args.launches)]
    summary = report(launches)
    if args.json:
        with open(args.json, "w") as stream:
            json.dump({"launches": launches, "summary": summary}, stream)


if __name__ == "__main__":
    main()
