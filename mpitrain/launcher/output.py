"""The ranks' output on its way from mpirun to mpitrainrun's stdout and stderr.

Both of mpirun's streams come through mpitrainrun, taken apart into lines
(Open MPI forwards only whole lines anyway), and change on the way:

- A failed rank's traceback comes out in one piece. Its first line says how
  many lines follow (runtime/faults.py); mpitrainrun holds them until the
  last has come, since Open MPI forwards a rank's output in pieces of 4 KiB
  and two ranks that fail together would otherwise interleave theirs.
- A line that a progress bar (tqdm, Keras) redraws with carriage returns
  gets the rank tag on every piece, not only the first: a terminal shows the
  tag on the bar as it redraws, and `tr '\\r' '\\n' < log | grep '^\\[1,0\\]'`
  finds each update of rank 0's bar.
- TensorFlow's start-up notices go when the job asks TensorFlow for no INFO
  lines (quiet.py).
- Open MPI's boxes about how the job ended are held back, unless the user
  asked for --verbose, and read into sentences (endings.py) that mpitrainrun
  prints as one line at the end; so go the tagged NUL byte Open MPI writes
  into the stderr of a rank that aborts, and libevent's warning about a
  rank's pipe closed under it as the job ends.
- A rank's "ModuleNotFoundError: No module named 'keras'" (of a module the
  examples use) is read into a sentence on what installs it, which the line
  at the end adds.

A box is recognized by its rule and first line, so a rank's own line of 74
dashes waits for that rank's next line on the same stream before it is shown.
"""

import re
import threading

from mpitrain.launcher import endings, quiet
from mpitrain.runtime import faults

# A rank's tag: Open MPI's --tag-output "[1,0]<stdout>: ", MPICH's -prepend-rank "[0] ".
TAG = re.compile(rb"^\[\d+(?:,\d+)?\](?:<std(?:out|err)>:)? ")


class Passage:
    """What one of mpirun's streams becomes, a line at a time: line() returns
    the lines to write for a line read, end() those still held at its end."""

    def __init__(self, tagged, drop_notices, show_boxes):
        self.tagged = tagged
        self.drop_notices = drop_notices
        self.show_boxes = show_boxes
        self.sentences = []         # what the boxes held back said
        self.installs = []          # what installs the modules ranks found missing
        self.boxes = {}             # rank tag -> the lines of a box being read
        self.tracebacks = {}        # rank tag -> [lines still to come, lines held]
        self.unfinished = {}        # rank tag -> the start of a line a box cut

    def split(self, line):
        """(its rank tag or b"", the rest)."""
        found = TAG.match(line) if self.tagged else None
        return (found.group(), line[found.end():]) if found else (b"", line)

    def line(self, line):
        tag, text = self.split(line)
        if text.startswith(b"\0"):
            # After the NUL: the rank's next line, or (the rank ended) another's.
            rest = text.lstrip(b"\0")
            return self.line(rest if self.split(rest)[0] else tag + rest) if rest else []
        if self.drop_notices and quiet.NOTICE.match(text):
            return []
        if not self.show_boxes and endings.EVENT_LOOP_WARNING.match(text):
            return []
        install = endings.what_installs(text.decode(errors="replace"))
        if install is not None and install not in self.installs:
            self.installs.append(install)
        ended = text.rstrip(b"\r\n")
        if tag and ended.endswith(endings.RULE) and ended != endings.RULE:
            # A box came in the middle of the rank's line (Open MPI forwarded
            # the line's first 4 KiB piece): the line's start waits for its
            # rest, which comes after the box.
            cut = len(ended) - len(endings.RULE)
            self.unfinished[tag] = self.unfinished.get(tag, b"") + text[:cut]
            line, text = tag + text[cut:], text[cut:]
        box = self.boxes.pop(tag, None)
        if box is None:
            if text.rstrip(b"\r\n") == endings.RULE:
                self.boxes[tag] = [line]
                return []
            return self.ranks_lines(tag, [line])
        box.append(line)
        if len(box) == 2 and not endings.opens_a_box(text):
            return self.ranks_lines(tag, box)
        if len(box) == 2 or text.rstrip(b"\r\n") != endings.RULE:
            self.boxes[tag] = box
            return []
        said = endings.sentence(b"".join(self.split(held)[1] for held in box)
                                .decode(errors="replace"))
        if said is not None:
            self.sentences.append(said)
        return box if self.show_boxes else []

    def ranks_lines(self, tag, lines):
        """Of a rank's own lines (not Open MPI's boxes), those to write now:
        a traceback is held until its last line has come."""
        if tag in self.unfinished:
            lines = [tag + self.unfinished.pop(tag) + self.split(lines[0])[1]] + lines[1:]
        shown = []
        for line in map(self.every_piece_tagged, lines):
            traceback = self.tracebacks.get(tag)
            if traceback is not None:
                traceback[1].append(line)
                traceback[0] -= 1
                if not traceback[0]:
                    shown += self.tracebacks.pop(tag)[1]
            elif tag and (follow := faults.traceback_lines(
                    self.split(line)[1].decode(errors="replace"))):
                self.tracebacks[tag] = [follow, [line]]
            else:
                shown.append(line)
        return shown

    def end(self):
        """The lines still held when the stream ended: the start of a line
        whose rest never came, tracebacks whose rank was ended before it
        wrote them all, boxes still open."""
        held = [piece for tag in list(self.unfinished)
                for piece in self.ranks_lines(tag, [tag])]
        held += [line for _, lines in self.tracebacks.values() for line in lines]
        held += [self.every_piece_tagged(line) for box in self.boxes.values()
                 for line in box]
        self.tracebacks.clear()
        self.boxes.clear()
        return held

    def every_piece_tagged(self, line):
        """The line with its tag also after each carriage return that starts
        a piece (not one that only ends the line, as in CR LF)."""
        tag, text = self.split(line)
        if not tag or b"\r" not in text:
            return line
        first, *others = text.split(b"\r")
        return tag + first + b"".join(
            b"\r" + (tag + piece if piece.strip(b"\n") else piece) for piece in others)


def copy(source, target, passage):
    """Copy the binary stream source to the binary stream target through
    passage, in a thread of its own; returns the thread, which ends with
    source. What one read brings is written and flushed at once. Once target
    is closed (a reader such as `head` went away) the rest is read and
    dropped, so that the ranks never block on a full pipe."""
    def run():
        writable, unfinished = True, b""
        for chunk in iter(lambda: source.read1(1 << 16), b""):
            *lines, unfinished = (unfinished + chunk).split(b"\n")
            shown = [piece for line in lines for piece in passage.line(line + b"\n")]
            writable = writable and write(target, b"".join(shown))
        shown = passage.line(unfinished) if unfinished else []
        write(target, b"".join(shown + passage.end()))

    thread = threading.Thread(target=run, name="mpitrainrun-output", daemon=True)
    thread.start()
    return thread


def write(target, data):
    """Write and flush; False once target cannot take more."""
    try:
        target.write(data)
        target.flush()
        return True
    except (OSError, ValueError):
        return False
