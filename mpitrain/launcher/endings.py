"""Open MPI's boxed messages about how a job ended, read as one sentence each.

When a rank fails, Open MPI frames what happened in boxes of dashes: the
rank's MPI library prints "MPI_ABORT was invoked on rank 1 ..." (9 lines)
and prterun "prterun has exited due to process rank 1 with PID 0 ...", "...
exited on signal 9 (Killed)" or "... exited with non-zero status" (4-6
lines). Next to the rank's own traceback they are noise, so mpitrainrun
holds them back (output.py) and says in one line at the end what they said
(run.py). A box not listed here (too few slots, a program missing on a
remote host, ...) tells the user what to do, and goes through as it is.
"""

import re

from mpitrain.launcher.check_build import INSTALL_TENSORFLOW, INSTALL_TORCH

# What libevent, inside Open MPI's launcher, prints now and then as the
# ranks of a failed job are ended: the pipe of a rank's output was closed
# under its event loop. It says nothing about the job, and comes without a
# rank tag ("[warn] Epoll MOD(4) on fd 21 failed. Old events were 6; read
# change was 2 (del); ...: Bad file descriptor"). Held back as the boxes are.
EVENT_LOOP_WARNING = re.compile(
    rb"^\[warn\] Epoll (ADD|MOD|DEL)\(\d+\) on fd \d+ failed\..*: Bad file descriptor\r?\n?$")

# The frame of Open MPI's help messages (its show_help).
RULE = b"-" * 74

# How a box that says how the job ended begins (its first line after the
# rule; Open MPI 4's launcher calls itself mpirun, 5's prterun).
OPENING = re.compile(rb"^(MPI_ABORT was invoked on rank \d|(prterun|mpirun) (has exited "
                     rb"due to process rank|noticed that process rank|detected that one "
                     rb"or more processes exited)|Primary job +terminated normally)")

# (what a box says, the sentence mpitrainrun makes of it); a box of a kind
# none of these reads (Open MPI 4's "Primary job" preface) says nothing more.
SENTENCES = (
    (re.compile(r"process rank (?P<rank>\d+) with PID \d+ on\s+node \S+ exited on\s+"
                r"signal (?P<signal>\d+) \((?P<name>[^)]+)\)"),
     "rank {rank} was killed by signal {signal} ({name})"),
    (re.compile(r"exited with non-zero status.*?Process name:\s+\[\S*,(?P<rank>\d+)\]\s+"
                r"Exit code:\s+(?P<code>\d+)", re.S),
     "rank {rank} exited with code {code}"),
    (re.compile(r"MPI_ABORT was invoked on rank (?P<rank>\d+) "), "rank {rank} called MPI_Abort"),
    (re.compile(r"due to process rank (?P<rank>\d+) with PID \d+ on\s+node \S+ calling"
                r"\s+\"abort\""), "rank {rank} called MPI_Abort"),
)


# The sentence SENTENCES makes of a rank killed by a signal.
KILLED = re.compile(r"rank (?P<rank>\d+) was killed by signal \d+ .*")


def killed_rank(sentences):
    """The rank Open MPI said was killed by a signal, or None."""
    for said in sentences:
        found = KILLED.fullmatch(said)
        if found:
            return int(found.group("rank"))
    return None


def opens_a_box(first_line):
    """Whether the first line of a box (its text after the rule) starts one
    of the boxes this module reads."""
    return bool(OPENING.match(first_line))


def sentence(box):
    """What a box (its text, without rank tags) says happened, or None."""
    for pattern, text in SENTENCES:
        found = pattern.search(box)
        if found:
            return text.format(**found.groupdict())
    return None


def raised(report):
    """The exception line ("RuntimeError: ...") of the last traceback in a
    rank's report (runtime/launch_report.py), or its last line."""
    lines = report.rstrip().splitlines() or [""]
    starts = [number for number, line in enumerate(lines)
              if line.startswith("Traceback (most recent call last):")]
    if starts:
        for line in lines[starts[-1] + 1:]:
            if line and not line[0].isspace():
                return line
    return lines[-1]


# A rank's "ModuleNotFoundError: No module named 'keras'", and what brings
# each module the examples import (the README's first command installs no
# TensorFlow, and the Keras examples stopped there without a word on it).
MISSING_MODULE = re.compile(r"^ModuleNotFoundError: No module named '(?P<module>\w+)")
BROUGHT_BY = {
    "keras": ("TensorFlow", INSTALL_TENSORFLOW),
    "tensorflow": ("TensorFlow", INSTALL_TENSORFLOW),
    "torch": ("PyTorch", INSTALL_TORCH),
    "sklearn": ("the examples extra", "pip install -c constraints.txt -e '.[examples]'"),
    "tqdm": ("the examples extra", "pip install -c constraints.txt -e '.[examples]'"),
}


def what_installs(line):
    """For a rank's line saying a module the examples use is missing, a
    sentence on what installs it; else None."""
    found = MISSING_MODULE.match(line)
    if found is None or found.group("module") not in BROUGHT_BY:
        return None
    what, install = BROUGHT_BY[found.group("module")]
    return (f"{found.group('module')} is not installed here: it comes with {what} "
            f"({install}; docs/installing.md)")


def ranks_text(ranks):
    """[1] -> 'rank 1', [0, 2, 3] -> 'ranks 0, 2 and 3'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def summary(code, reports, sentences, most=3):
    """The one line that says how a failed job ended: what the failed ranks
    raised (reports: {rank: report}), else what Open MPI's boxes said."""
    if reports:
        failed = {}
        for rank, report in sorted(reports.items()):
            exception = raised(report)
            if len(exception) > 300:
                exception = exception[:297] + "..."
            failed.setdefault(exception, []).append(rank)
        causes = [f"{ranks_text(ranks)} failed with {exception}"
                  for exception, ranks in failed.items()]
        if len(causes) > most:
            left = sum(len(ranks) for ranks in list(failed.values())[most:])
            causes = causes[:most] + [f"{left} more ranks failed too"]
        cause = "; ".join(causes) + (" (traceback above)" if len(reports) == 1
                                     else " (tracebacks above)")
        cause = "; ".join([cause] + list(dict.fromkeys(
            filter(None, map(what_installs, failed)))))
    else:
        cause = "; ".join(dict.fromkeys(sentences))
    return f"{cause}; the job ended with exit code {code}" if cause else \
        f"the job ended with exit code {code}"
