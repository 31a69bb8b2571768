"""mpirun as mpitrainrun's child, the part both ways of running a job share
(one mpirun, run.py; one after another, elastic.py): the ranks' output
passes through output.py, SIGTERM and SIGHUP to mpitrainrun are forwarded
to it, the elastic supervisor can abandon it, and a failed job ends with
one line on how it ended (endings.py) instead of Open MPI's boxes.
"""

import contextlib
import signal
import subprocess
import sys
import tempfile

from mpitrain.launcher import endings, output, quiet
from mpitrain.launcher.hosts import cores, shares_cores
from mpitrain.runtime import launch_report

# What mpitrainrun passes on to mpirun, which ends the job on either; Ctrl-C
# from a terminal reaches mpirun by itself.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def warn(message):
    print(f"mpitrainrun: {message}", file=sys.stderr)


class Stopping(Exception):
    """A signal to mpitrainrun (one of FORWARDED_SIGNALS) ends the job."""

    def __init__(self, number):
        super().__init__(f"{signal.Signals(number).name}: ending the job")
        self.number = number


def raise_stopping(number, _):
    """A signal handler: end what runs with Stopping."""
    raise Stopping(number)


@contextlib.contextmanager
def signals_handled_by(handler):
    """FORWARDED_SIGNALS go to ``handler`` inside the block, and to the
    handlers from before it after."""
    before = {number: signal.signal(number, handler) for number in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for number, previous in before.items():
            signal.signal(number, previous)


def run(line, env, tagged, verbose, abandon=None):
    """Run mpirun with its output through output.py; returns its exit code
    (128 + N if signal N ended it or mpitrainrun) and what Open MPI's boxes
    said about how the job ended, then what installs the modules the ranks
    found missing (None if a signal to mpitrainrun ended it).
    Setting ``abandon`` (a threading.Event) ends mpirun."""
    out = output.Passage(tagged, drop_notices=False, show_boxes=verbose)
    err = output.Passage(tagged, drop_notices=quiet.wanted(env), show_boxes=verbose)
    sys.stdout.flush()
    sys.stderr.flush()
    process = subprocess.Popen(line, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    copying = [output.copy(process.stdout, sys.stdout.buffer, out),
               output.copy(process.stderr, sys.stderr.buffer, err)]
    received = []

    def forward(number, _):
        process.send_signal(number)
        received.append(number)
        if len(received) == 1:
            raise Stopping(number)

    with signals_handled_by(forward):
        try:
            code = wait_unless(process, abandon)
        except (KeyboardInterrupt, Stopping):
            if received:
                warn(Stopping(received[0]))
            # mpirun got the signal too (from the terminal, or forwarded) and
            # is ending the ranks; give it that time before stopping it ourselves.
            try:
                code = process.wait(timeout=10)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                process.terminate()
                code = process.wait()
    for thread in copying:
        # What the ranks wrote last comes before anything printed after the
        # job; a daemon left holding the pipe must not keep us waiting.
        thread.join(timeout=5)
    if received:
        return 128 + received[0], None
    return 128 - code if code < 0 else code, out.sentences + err.sentences + err.installs


def wait_unless(process, abandon):
    """process.wait(); but once ``abandon`` is set, SIGTERM the process, and
    SIGKILL it 10 s later (mpirun waiting for a host it cannot reach)."""
    while abandon is not None and process.poll() is None:
        if abandon.wait(0.5):
            process.terminate()
            try:
                return process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
    return process.wait()


def warn_before_start(env, environ, hosts, nprocs):
    """What the user should know before the ranks start: that mpitrainrun
    let Open MPI run as root, and that the ranks share cores."""
    if env.get("OMPI_ALLOW_RUN_AS_ROOT") != environ.get("OMPI_ALLOW_RUN_AS_ROOT"):
        warn("running as root: allowing Open MPI to start (OMPI_ALLOW_RUN_AS_ROOT=1)")
    if shares_cores(hosts, nprocs):
        warn(f"{nprocs} ranks on {cores()} cores: oversubscribing, so "
             "ranks share cores and each runs slower")


def run_with_reports(line, env, local, tagged, verbose, abandon=None):
    """run(), and the reports of the ranks that aborted the job ({rank: report})."""
    with tempfile.TemporaryDirectory(prefix="mpitrainrun-") as directory:
        if local:           # ranks on other hosts cannot write here
            env = {**env, launch_report.VARIABLE: directory}
        code, sentences = run(line, env, tagged, verbose, abandon)
        return code, sentences, launch_report.reports(directory)


def run_and_report(line, env, local, tagged, verbose):
    """run(), then one line saying how a failed job ended: which ranks
    failed with which exception, from their reports, or what Open MPI said."""
    code, sentences, reports = run_with_reports(line, env, local, tagged, verbose)
    if code and sentences is not None:
        warn(endings.summary(code, reports, sentences))
    return code
