"""cloudpickle that keeps the file a function's code was written in.

cloudpickle 3.1.3 and later name every code object they pickle by value
"<dynamic-code>", so a rank's traceback would lose the user's file name and
source lines (linecache finds nothing to show). Functions of modules the ranks
can import travel by reference and keep theirs anyway; this keeps the file
for the others (functions of ``__main__``, lambdas, closures).
"""

import types
from collections import ChainMap

import cloudpickle


def _code_in_its_file(make_code, args, filename):
    return make_code(*args).replace(co_filename=filename)


def _reduce_code(code):
    make_code, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    return _code_in_its_file, (make_code, args, code.co_filename)


class _LocatedPickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _reduce_code},
                              cloudpickle.Pickler.dispatch_table)


def dump(value, file):
    """cloudpickle.dump(value, file), code objects keeping their file name."""
    _LocatedPickler(file, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(value)
