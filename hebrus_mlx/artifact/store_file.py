"""Read-only handle on one untrusted store file: validated on open, exact-length preads."""

import os

from .errors import TruncatedError


class StoreFile:
    """Subclasses implement `_open(*args)` to validate the file's header; a failed validation
    closes the descriptor before the error leaves the constructor."""

    def __init__(self, path, *open_args):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            self._open(*open_args)
        except BaseException:
            os.close(self.fd)
            raise

    def _open(self, *open_args):
        raise NotImplementedError

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _pread(self, n, offset, field):
        """Exactly n bytes at offset, or TruncatedError naming the field."""
        data = os.pread(self.fd, n, offset)
        if len(data) != n:
            raise TruncatedError(field, f"read {len(data)} of {n} bytes at offset {offset}")
        return data
