"""Names of unnamed calls: where in the program they were made, and who may make them.

Each process set numbers its unnamed calls per kind, in the order one thread
makes them; ranks pair them by number, and check that the numbers come from
the same place in the program. Once a pair came from different places the
numbers of that kind are out of step for good, so every later unnamed call
of that kind fails, naming the first mismatch, instead of pairing tensors of
different steps.
"""

import os
import re
import sys
import threading

from mpitrain.errors import MismatchError

# the mpitrain package, two levels up from mpitrain/engine/naming.py
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def call_site():
    """'file.py:line' of the first frame outside mpitrain: the user's call."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None:
        return ""
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


class Numbering:
    """One process set's numbers for unnamed calls: a counter per kind, the
    thread that takes them, and the kinds whose numbers stopped pairing up."""

    def __init__(self, set_id):
        self.set_id = set_id
        self.counters = {}
        self.thread = None        # the one thread that makes unnamed calls
        self.stopped = {}         # kind label -> the error that ended its numbering

    def take(self, kind, site):
        """The AutoName of this unnamed call of ``kind``, made at ``site``.

        The numbers belong to the first thread that takes one, and pass to
        another once that thread has ended: two threads that run together
        interleave their calls differently on each rank.
        """
        thread = threading.current_thread()
        if self.thread is None or not self.thread.is_alive():
            self.thread = thread
        elif self.thread is not thread:
            raise ValueError(
                f"an unnamed {kind.label} from thread {thread.name!r}: process set "
                f"{self.set_id} numbers unnamed calls in the order they come, and its "
                f"first came from thread {self.thread.name!r}, which still runs. Calls "
                "from two threads interleave differently on each rank and would pair "
                "the wrong tensors: pass name=... to the collectives of all but one "
                "thread")
        first_error = self.stopped.get(kind.label)
        if first_error is not None:
            raise MismatchError(f"an unnamed {kind.label} on process set {self.set_id}: "
                                + stopped(kind.label, first_error))
        number = self.counters.get(kind, 0)
        self.counters[kind] = number + 1
        return AutoName(f"{kind.label}.noname.{number}", site)

    def stop(self, label, first_error):
        """No more unnamed calls of kind ``label``: their numbers are out of step."""
        self.stopped.setdefault(label, first_error)


_NUMBERED = re.compile(r"([a-z_]+)\.noname\.[0-9]+")


def numbered_kind(name):
    """The kind's label of a numbered unnamed call's name, or of a name derived
    from one (a group member, an autograd op's gradient); else None."""
    match = _NUMBERED.match(name)
    return match.group(1) if match else None


def stopped(label, first_error):
    """Why an unnamed call of kind ``label`` fails once its numbers are out of step."""
    return (f"unnamed {label}s no longer pair up since the first that did not: "
            f"{first_error}. Every later unnamed {label} fails; pass name=... to "
            "each call")


class AutoName(str):
    """The name mpitrain gave an unnamed call, remembering where it was made.

    Names derived from it (the pieces of an object collective, the gradient
    of an autograd op) keep the place, so every call they make is checked.
    """

    __slots__ = ("site",)

    def __new__(cls, name, site):
        made = super().__new__(cls, name)
        made.site = site
        return made

    def __reduce__(self):
        return AutoName, (str(self), self.site)


def derived(name, suffix):
    """``name`` + ``suffix``, still an AutoName where ``name`` is one."""
    if type(name) is AutoName:
        return AutoName(f"{name}{suffix}", name.site)
    return f"{name}{suffix}"


def split(name):
    """(the name as a plain string, its call site or "")."""
    if type(name) is AutoName:
        return str.__str__(name), name.site
    return name, ""
