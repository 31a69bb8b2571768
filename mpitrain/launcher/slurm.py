"""The hosts of the Slurm allocation mpitrainrun runs in, from Slurm's environment.

Inside `sbatch` or `salloc`, Slurm names the job's nodes in its compressed
form, SLURM_JOB_NODELIST=gpu[01-04,07],login1, and the tasks each node may
run as counts with repeats, SLURM_TASKS_PER_NODE=2(x3),1 (2 on each of the
first three nodes, then 1). mpitrainrun without -H turns them into hosts and
slots, so that `mpitrainrun -np N python train.py` runs on the allocation's
nodes with Open MPI or MPICH alike, and --dry-run shows where each rank goes.
Open MPI then starts its daemons on the other nodes through Slurm (srun).
"""

import re

NODE_LIST_VARIABLES = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
TASKS_VARIABLE = "SLURM_TASKS_PER_NODE"


def expand_node_list(text):
    """'gpu[01-03,07],cpu1' -> ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'cpu1'], as
    `scontrol show hostnames` expands it; a ValueError says what is wrong."""
    names = []
    for item in _top_level_items(text):
        names += _expand_item(item, text)
    return names


def expand_task_counts(text):
    """'2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match or int(match.group(1)) < 1:
            raise ValueError(f"{TASKS_VARIABLE}={text}: {part!r} is not N or N(xM) "
                             "(N tasks on each of M nodes)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def allocation(environ):
    """([(node, slots)], the variables read) of the allocation this process
    runs in, or None outside one."""
    name = next((name for name in NODE_LIST_VARIABLES if environ.get(name)), None)
    if name is None or TASKS_VARIABLE not in environ:
        return None
    nodes = expand_node_list(environ[name])
    counts = expand_task_counts(environ[TASKS_VARIABLE])
    if len(nodes) != len(counts):
        raise ValueError(f"{name}={environ[name]} names {len(nodes)} nodes but "
                         f"{TASKS_VARIABLE}={environ[TASKS_VARIABLE]} gives task counts "
                         f"for {len(counts)}")
    return list(zip(nodes, counts)), (f"{name}={environ[name]}, "
                                      f"{TASKS_VARIABLE}={environ[TASKS_VARIABLE]}")


def _top_level_items(text):
    """The list's items: commas inside brackets separate numbers, not items."""
    items, depth, start = [], 0, 0
    for at, char in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"{text!r} is not a Slurm node list: unbalanced brackets")
        if char == "," and depth == 0:
            if at > start:          # scontrol skips empty names too
                items.append(text[start:at])
            start = at + 1
    if depth:
        raise ValueError(f"{text!r} is not a Slurm node list: unbalanced brackets")
    return items


def _expand_item(item, text):
    """One name with bracketed ranges, each bracket multiplying the names:
    'r[1-2]n[1-2]' -> r1n1, r1n2, r2n1, r2n2."""
    match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]*)\](.*)", item)
    if match is None:
        if "[" in item or "]" in item:
            raise ValueError(f"{text!r} is not a Slurm node list: {item!r}")
        return [item]
    prefix, ranges, rest = match.groups()
    tails = _expand_item(rest, text) if rest else [""]
    return [prefix + number + tail for number in _numbers(ranges, text) for tail in tails]


def _numbers(ranges, text):
    """'01-03,7' -> '01', '02', '03', '7': a range keeps the width of its
    first number (zero-padded names)."""
    for part in ranges.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not (high.isdigit() and int(high) >= int(low))):
            raise ValueError(f"{text!r} is not a Slurm node list: [{ranges}] holds "
                             f"{part!r}, not N or LOW-HIGH")
        for number in range(int(low), int(high or low) + 1):
            yield str(number).zfill(len(low))
