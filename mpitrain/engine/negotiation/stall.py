"""The stall inspector: reports names that some ranks never submit."""

import logging

from mpitrain.errors import RankNames

log = logging.getLogger("mpitrain.stall")

_NAMES_PER_RANK = 6


class StallInspector:
    def __init__(self, config, set_id, global_ranks):
        self.where = ("" if set_id == 0 else
                      f" on {RankNames(set_id, global_ranks).members}")
        self.disabled = config.stall_check_disable
        self.warn_after = config.stall_check_time
        self.shutdown_after = config.stall_shutdown_time
        self.global_ranks = global_ranks     # set rank -> job rank
        self._last_warning = None

    def check(self, now, waiting, joined):
        """Warn about stalled names; return a report when the job must stop.

        waiting: name -> (first seen, set ranks that submitted it).
        """
        if self.disabled or not waiting:
            return None
        ages = {name: now - first for name, (first, _) in waiting.items()}
        oldest = max(ages.values())
        if self.shutdown_after and oldest >= self.shutdown_after:
            return self.report(waiting, ages, joined,
                               f"one has waited {self.shutdown_after:g} s, so mpitrain "
                               "is shutting down the job")
        due = (self._last_warning is None
               or now - self._last_warning >= self.warn_after)
        if oldest >= self.warn_after and due:
            self._last_warning = now
            log.warning("%s", self.report(waiting, ages, joined,
                                          "this will deadlock if it goes on"))
        return None

    def report(self, waiting, ages, joined, consequence):
        """Every name stalled past the check time, with the ranks it misses.

        Also at shutdown: names the other ranks submitted a moment later
        than the oldest one belong in the report as much as it does.
        """
        threshold = min(self.warn_after, self.shutdown_after or self.warn_after)
        missing = self._missing(waiting, ages, joined, threshold)
        lines = [
            f"stall: operations{self.where} have waited more than {threshold:g} s for other "
            f"ranks; {consequence}. Usually some ranks submitted different "
            "tensor names, or stopped submitting (an exception, a different "
            "number of steps, a data-dependent branch). Missing ranks:"]
        for rank, names in sorted(missing.items()):
            shown = ", ".join(f"'{n}'" for n in names[:_NAMES_PER_RANK])
            more = len(names) - _NAMES_PER_RANK
            suffix = f" (+{more} more)" if more > 0 else ""
            lines.append(f"  rank {self.global_ranks[rank]}: {shown}{suffix}")
        return "\n".join(lines)

    def missing_ranks(self, now, waiting, joined):
        """The job ranks that have not submitted a name stalled past the shutdown time."""
        ages = {name: now - first for name, (first, _) in waiting.items()}
        return [self.global_ranks[rank] for rank in
                self._missing(waiting, ages, joined, self.shutdown_after)]

    def _missing(self, waiting, ages, joined, threshold):
        """{set rank: names it has not submitted} of names older than threshold."""
        missing = {}
        for name, (_, present) in waiting.items():
            if ages[name] < threshold:
                continue
            for rank in range(len(self.global_ranks)):
                if rank not in present and rank not in joined:
                    missing.setdefault(rank, []).append(name)
        return missing
