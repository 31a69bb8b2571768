"""Ending the whole job when one rank dies of an unhandled exception.

A rank that ends with an exception leaves its peers waiting wherever they
are: in a collective of their own, in a data loader, or in MPI_Finalize,
which under Open MPI waits for every rank. The job then holds its machines
until someone kills it. Like ``python -m mpi4py``, mpitrain prints the error
with the rank and calls MPI_Abort, after which the launcher ends every rank.

The rank's line and its traceback go out in one write, and that line says
how many lines of traceback follow: two ranks that fail at once would
otherwise interleave their tracebacks line by line, and Open MPI forwards a
rank's output in pieces of 4 KiB, so mpitrainrun keeps a rank's lines
together by that count (launcher/output.py).

init() installs this once per process (MPITRAIN_ABORT_ON_EXCEPTION=0 turns it
off). It wraps the hooks already in place, so their output still appears, and
it leaves alone single-rank jobs, interactive sessions (where an exception
does not end the program), SystemExit, and processes forked from the rank
(data loader workers), which must not abort their parent's job.
"""

import io
import os
import re
import socket
import sys
import threading

from mpitrain.runtime import launch_report

_installed_in = None        # pid of the process whose hooks are ours

# The end of the line a failed rank writes first, with the number of lines
# of its traceback that come after it.
TRACEBACK_FOLLOWS = re.compile(r"\. Its traceback, (\d+) lines?:$")


def abort_on_unhandled_exceptions(enabled):
    """Install the hooks (called by init(); later calls do nothing)."""
    global _installed_in
    if not enabled or _installed_in == os.getpid() or _interactive():
        return
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_size() < 2:
        return
    _installed_in = os.getpid()
    sys.excepthook = _aborting(sys.excepthook, "")
    previous = threading.excepthook

    def thread_hook(args):
        if args.exc_type is SystemExit or os.getpid() != _installed_in:
            return previous(args)
        name = args.thread.name if args.thread is not None else "?"
        _report(f" in thread '{name}'", lambda: previous(args))
        _abort()

    threading.excepthook = thread_hook


def _aborting(previous, where):
    def hook(kind, value, traceback):
        if os.getpid() != _installed_in:
            return previous(kind, value, traceback)
        _report(where, lambda: previous(kind, value, traceback))
        _abort()
    return hook


def _report(where, print_traceback):
    """Write the rank's line and what print_traceback (the hook before ours)
    writes to sys.stderr, in one write."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    launch_report.copy_stderr(world.Get_rank())
    stream, sys.stderr = sys.stderr, io.StringIO()
    try:
        print_traceback()
    finally:
        printed, sys.stderr = sys.stderr.getvalue(), stream
        if printed and not printed.endswith("\n"):
            printed += "\n"
        lines = printed.count("\n")
        follows = f". Its traceback, {lines} line{'s' * (lines != 1)}:" if lines else "."
        stream.write(
            f"mpitrain: rank {world.Get_rank()} of {world.Get_size()} (host "
            f"{socket.gethostname()}, pid {os.getpid()}) failed with an unhandled "
            f"exception{where}; aborting the MPI job so that the other ranks do not "
            f"wait for it forever (MPITRAIN_ABORT_ON_EXCEPTION=0 turns this off)"
            f"{follows}\n{printed}")


def traceback_lines(line):
    """How many lines of traceback follow ``line`` (a rank's, without its
    tag), if it is the line a failed rank writes first; else None."""
    found = TRACEBACK_FOLLOWS.search(line.rstrip("\r\n")) if line.startswith(
        "mpitrain: rank ") else None
    return int(found.group(1)) if found else None


def _abort():
    from mpi4py import MPI
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):      # closed or broken: nothing to save
            pass
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.COMM_WORLD.Abort(1)


def _interactive():
    return hasattr(sys, "ps1") or sys.flags.interactive
