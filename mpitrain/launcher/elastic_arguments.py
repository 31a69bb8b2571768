"""mpitrainrun's elastic flags, Horovod's, and their checks.

A host discovery script, or --min-np with -H or --hostfile, makes a job
elastic (launcher/elastic.py); the other flags of this group need one of
them.
"""

from mpitrain.launcher.discovery import COOLDOWN_LIMITS, LOSSES_LEAVING_OUT

DEFAULT_ELASTIC_TIMEOUT = 600


def add_arguments(parser):
    group = parser.add_argument_group(
        "elastic training (docs/fault-tolerance.md): the job goes on after a rank or "
        "host is lost, and grows with new hosts")
    group.add_argument("--host-discovery-script", metavar="SCRIPT",
                       help="a program that prints the hosts available now, one a "
                            "line: host:slots, or host (--slots slots); run every second")
    group.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, metavar="N",
                       help="the fewest ranks the job goes on with; with fewer it waits "
                            "--elastic-timeout for hosts (default: -np)")
    group.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, metavar="N",
                       help="the most ranks the job grows to (default: no limit)")
    group.add_argument("--slots", "--slots-per-host", dest="slots", type=int, metavar="N",
                       help="slots of a host the discovery script prints without any "
                            "(default 1)")
    group.add_argument("--elastic-timeout", type=float, metavar="S",
                       help="how long to wait for enough slots to start or restart "
                            f"the job (default {DEFAULT_ELASTIC_TIMEOUT})")
    group.add_argument("--reset-limit", type=int, metavar="N",
                       help="end the job instead of starting it a time more after N "
                            "restarts (default: no limit)")
    group.add_argument("--blacklist-cooldown-range", type=int, nargs=2,
                       metavar=("MIN", "MAX"),
                       help="Horovod's blacklist: every rank lost on a host leaves it "
                            "out for seconds growing with each loss from MIN to MAX "
                            "(default: a host stays in until it cannot be reached or "
                            f"has lost {LOSSES_LEAVING_OUT} ranks)")


def is_elastic(args):
    return args.host_discovery_script is not None or args.min_np is not None


def check(parser, args):
    """Refuse elastic flags that do not fit together, before anything starts;
    fills in -np and --min-np from each other."""
    given = [flag for flag, value in (
        ("--max-np", args.max_np), ("--slots", args.slots),
        ("--elastic-timeout", args.elastic_timeout), ("--reset-limit", args.reset_limit),
        ("--blacklist-cooldown-range", args.blacklist_cooldown_range))
        if value is not None]
    if not is_elastic(args):
        if given:
            parser.error(f"{given[0]} is for elastic jobs: give --host-discovery-script "
                         f"(or --min-np with -H or --hostfile)")
        return
    if args.host_discovery_script and (args.hosts or args.hostfile):
        parser.error("give --host-discovery-script or -H/--hostfile, not both")
    if not args.host_discovery_script and not (args.hosts or args.hostfile):
        parser.error("--min-np needs the hosts to choose from: --host-discovery-script, "
                     "-H or --hostfile")
    if args.nprocs is None:
        args.nprocs = args.min_np
    if args.min_np is None:
        args.min_np = args.nprocs
    if args.nprocs is None:
        parser.error("give the number of ranks to start with, -np N")
    for flag, value in (("-np", args.nprocs), ("--min-np", args.min_np),
                        ("--max-np", args.max_np), ("--slots", args.slots),
                        ("--reset-limit", args.reset_limit)):
        if value is not None and value < (0 if flag == "--reset-limit" else 1):
            parser.error(f"{flag} must be at least {0 if flag == '--reset-limit' else 1}, "
                         f"not {value}")
    if args.min_np > args.nprocs:
        parser.error(f"--min-np {args.min_np} is more than -np {args.nprocs}")
    if args.max_np is not None and args.max_np < args.nprocs:
        parser.error(f"--max-np {args.max_np} is less than -np {args.nprocs}")
    if args.elastic_timeout is None:
        args.elastic_timeout = DEFAULT_ELASTIC_TIMEOUT
    elif not 0 < args.elastic_timeout < float("inf"):
        parser.error(f"--elastic-timeout must be a number of seconds > 0, not "
                     f"{args.elastic_timeout}")
    if args.blacklist_cooldown_range is not None:
        low, high = args.blacklist_cooldown_range
        if not COOLDOWN_LIMITS[0] <= low <= high <= COOLDOWN_LIMITS[1]:
            parser.error(f"--blacklist-cooldown-range {low} {high}: give MIN <= MAX, "
                         f"from {COOLDOWN_LIMITS[0]} to {COOLDOWN_LIMITS[1]} seconds")
    if args.slots is None:
        args.slots = 1
