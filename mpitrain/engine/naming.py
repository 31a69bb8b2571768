"""Names of unnamed calls: where in the program they were made, and who may make them."""

import os
import sys

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


def second_thread(kind, thread, first, set_id):
    return (f"an unnamed {kind.label} from thread {thread.name!r}: process set {set_id} "
            "numbers unnamed calls in the order they come, and its first came from "
            f"thread {first.name!r}. Calls from two threads interleave differently on "
            "each rank and would pair the wrong tensors: pass name=... to the "
            "collectives of all but one thread")


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
