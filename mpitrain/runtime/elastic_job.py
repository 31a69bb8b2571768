"""What mpitrainrun's elastic mode and its ranks share.

mpitrainrun (launcher/elastic.py) starts each run of an elastic job with
these variables; a rank that finds them talks back to it over one TCP line
(api/elastic_channel.py) and keeps its commits in a directory of its host
(api/elastic_store.py), which the launcher has removed when the job ends
(``python -m mpitrain.runtime.elastic_job remove``, on every host). The
messages on the line are JSON objects, one a line.
"""

import dataclasses
import json
import os
import shutil
import socket
import sys

from mpitrain.runtime import config

ADDRESS = "MPITRAIN_ELASTIC_ADDRESS"    # host:port where mpitrainrun listens
TOKEN = "MPITRAIN_ELASTIC_TOKEN"        # a secret the ranks prove they belong with
JOB = "MPITRAIN_ELASTIC_JOB"            # names the job's commit directories
RESTARTS = "MPITRAIN_ELASTIC_RESTARTS"  # how many times the job was started again


@dataclasses.dataclass(frozen=True)
class Job:
    """The elastic job this process is a rank of."""
    address: str
    token: str
    job_id: str
    restarts: int
    directory: str          # MPITRAIN_ELASTIC_DIR

    def host_directory(self):
        """This host's folder of commits: one per host even where
        MPITRAIN_ELASTIC_DIR is a file system the hosts share."""
        return os.path.join(job_directory(self.directory, self.job_id),
                            socket.gethostname())


def job_directory(base, job_id):
    return os.path.join(base, f"mpitrain-elastic-{job_id}")


def this_job(environ=None):
    """The Job, or None in a process mpitrainrun's elastic mode did not start."""
    environ = os.environ if environ is None else environ
    if ADDRESS not in environ:
        return None
    return Job(environ[ADDRESS], environ[TOKEN], environ[JOB], int(environ[RESTARTS]),
               config.from_environ(environ).elastic_dir)


def encode(message):
    return (json.dumps(message) + "\n").encode()


def decode(line):
    """The message on a line, or None for a line that is not one."""
    try:
        message = json.loads(line)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def remove_this_hosts_commits(job):
    """Remove this host's commits of the job, and the job's folder once empty."""
    shutil.rmtree(job.host_directory(), ignore_errors=True)
    try:
        os.rmdir(job_directory(job.directory, job.job_id))
    except OSError:
        pass                    # another host's folder is still in it, or it is gone


if __name__ == "__main__" and sys.argv[1:] == ["remove"]:
    remove_this_hosts_commits(this_job())
