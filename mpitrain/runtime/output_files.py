"""Files mpitrain writes for the user: the timeline and the autotune log.

They are opened without following a symbolic link: a link planted under the
expected name (in a shared /tmp, say) would otherwise make a rank truncate
whatever file it points to.
"""

import errno
import os


def create(path):
    """A descriptor of ``path``, emptied or created (mode 0644 less the umask)."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                       0o644)
    except OSError as error:
        if error.errno == errno.ELOOP and os.path.islink(path):
            raise OSError(errno.ELOOP, f"{path} is a symbolic link, which mpitrain "
                                       "does not write through (it would empty the "
                                       "file it points to); give the real path") from None
        raise
