"""Horovod's names that an mpitrain module lacks, and where to go instead.

A module ends with ``__getattr__ = horovod_names.module_getattr(...)``: a
name of its table fails with a HorovodNameError that says where mpitrain
has it or why it does not; a lazy name is imported on first use, so that
importing the module stays as fast as before.
"""

import importlib
import sys


INTERNAL_HELPER = ("is a helper Horovod's module imports for its own use, not part of "
                   "Horovod's API; mpitrain has none")


class HorovodNameError(AttributeError):
    """A Horovod name this mpitrain module does not have; the message says
    where its equivalent is. An AttributeError, so hasattr() answers False."""


def module_getattr(module, horovod_module, missing, lazy=None):
    """The ``__getattr__`` of ``module``: ``missing`` maps Horovod's names to
    where they are instead; ``lazy`` maps names to (module, attribute or None
    for the module itself) to import when first asked for."""
    lazy = lazy or {}

    def __getattr__(name):
        if name in lazy:
            source, attribute = lazy[name]
            value = importlib.import_module(source)
            if attribute is not None:
                value = getattr(value, attribute)
            setattr(sys.modules[module], name, value)
            return value
        if name in missing:
            raise HorovodNameError(
                f"module {module!r} has no attribute {name!r}: Horovod's "
                f"{horovod_module}.{name} {missing[name]} (docs/migrating-from-horovod.md)")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
