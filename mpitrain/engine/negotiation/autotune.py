"""Autotune: choose fusion threshold, chunk size and cycle time on the live job.

Rank 0 measures the job-wide set's allreduce throughput (bytes reduced per
second of wall time) over samples of a few training steps, tries candidate
values one parameter at a time, and keeps the best. Every change travels to
all ranks inside a negotiation round, so they switch at the same round.
Values the user set explicitly are never changed.
"""

import csv
import logging
import statistics

from mpitrain.runtime import output_files

log = logging.getLogger("mpitrain")

MiB = 1 << 20
CANDIDATES = {
    "chunk_size": [1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB],
    "fusion_threshold": [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB],
    "cycle_time_ms": [0.25, 0.5, 1.0, 2.5, 5.0],
}
STEPS_PER_SAMPLE = 5       # a step: the sample's first tensor is reduced again
MAX_SAMPLE_SECONDS = 5.0   # ... or this long, for jobs without repeating names
WARMUP_SAMPLES = 1         # discarded after every change
SAMPLES = 3                # scored samples per candidate; the median counts


class Autotuner:
    def __init__(self, config, now):
        self.values = {name: getattr(config, name) for name in CANDIDATES}
        self._plan = [(name, value) for name in CANDIDATES
                      if name not in config.explicit for value in CANDIDATES[name]]
        self._scores = {}                  # candidate value -> median score
        self._log = self._writer = None
        if config.autotune_log:
            try:
                self._log = open(output_files.create(config.autotune_log), "w",
                                 newline="")
            except OSError as error:
                log.warning("no autotune log: %s; tuning goes on without one", error)
            else:
                self._writer = csv.writer(self._log)
                self._writer.writerow(["seconds", *CANDIDATES, "sample",
                                       "bytes_per_second"])
        self._origin = now
        self.pending = None                # values to send to every rank
        self.done = not self._plan
        self._samples = []
        self._sample_start = None
        self._next_candidate()

    def _next_candidate(self):
        if not self._plan:
            self.done = True
            log.info("autotune chose %s", self.values)
            self._write("best", "")
            if self._log:
                self._log.close()
            return
        name, value = self._plan[0]
        self.pending = dict(self.values, **{name: value})

    def shipped(self, now):
        """Every rank now uses self.pending: measuring starts."""
        self.values, self.pending = self.pending, None
        self._samples = []
        self._start_sample(now)

    def _start_sample(self, now):
        self._sample_start, self._bytes, self._marker, self._steps = now, 0, None, 0

    def observe(self, names, nbytes, now):
        """Account for one round: the allreduces it ran and the bytes they reduced."""
        if self.done or self.pending is not None or self._sample_start is None:
            return
        self._bytes += nbytes
        if self._marker is None and names:
            self._marker = names[0]
        elif self._marker in names:
            self._steps += 1
        elapsed = now - self._sample_start
        if self._steps < STEPS_PER_SAMPLE and elapsed < MAX_SAMPLE_SECONDS:
            return
        score = self._bytes / elapsed
        warming = len(self._samples) < WARMUP_SAMPLES
        self._samples.append(score)
        self._write("warm-up" if warming else len(self._samples) - WARMUP_SAMPLES,
                    f"{score:.0f}")
        self._start_sample(now)
        if len(self._samples) == WARMUP_SAMPLES + SAMPLES:
            self._finish_candidate()

    def _finish_candidate(self):
        name, value = self._plan.pop(0)
        self._scores[value] = statistics.median(self._samples[WARMUP_SAMPLES:])
        if not self._plan or self._plan[0][0] != name:
            best = max(self._scores, key=self._scores.get)
            self.values = dict(self.values, **{name: best})
            self._scores = {}
            if not self._plan:
                self.pending = self.values
                self._next_candidate()
                return
        self._next_candidate()

    def _write(self, sample, score):
        if not self._writer:
            return
        try:
            self._writer.writerow([f"{self._now_offset():.3f}", *self.values.values(),
                                   sample, score])
            self._log.flush()
        except OSError as error:            # a full disk: tuning goes on
            log.warning("the autotune log stops here: %s", error)
            self._writer = None
            try:
                self._log.close()
            except OSError:
                pass                         # what it still held is lost with the disk
            self._log = None

    def _now_offset(self):
        return (self._sample_start or self._origin) - self._origin
