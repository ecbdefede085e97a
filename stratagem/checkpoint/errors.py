"""Errors and warnings raised by ``stratagem.checkpoint``: every one is here, and every one
is exported by the package (``from stratagem.checkpoint import CheckpointVoteError``).

Every error names the file it is about, so a log line alone says which checkpoint to look at.
"""

from __future__ import annotations

import pickle


class CheckpointCorruptError(ValueError):
    """A checkpoint's bytes do not match its manifest (size or digest), or cannot be read.

    Raised before anything is unpickled.
    """


class NotACheckpointError(ValueError):
    """The file is not a PyTorch checkpoint (a text file, random bytes, another archive)."""


class UnsafeCheckpointError(pickle.UnpicklingError):
    """``torch.load(weights_only=True)`` refused the file: it references Python globals
    (classes, functions) outside the allowlist, so unpickling it could run code.

    A subclass of ``pickle.UnpicklingError`` so that code catching torch's own error keeps
    working. ``globals`` lists the offending names found in torch's message (may be empty).
    """

    def __init__(self, message: str, globals: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.globals = tuple(globals)


class CheckpointWarning(UserWarning):
    """Something about a checkpoint directory needed a fallback (pointer, manifest)."""


class UnverifiedCheckpointWarning(CheckpointWarning):
    """A checkpoint has no manifest (written by mmengine or plain ``torch.save``), so its
    integrity cannot be verified before loading."""


class StateDictMismatchError(RuntimeError, ValueError):
    """A state dict does not fit a module (strict load) or matches none of its keys.

    Raised before anything is copied: the module is unchanged. A ``RuntimeError`` like
    torch's strict-load error, and a ``ValueError`` like every other bad-input error here.
    """


class PartialLoadWarning(CheckpointWarning):
    """Fewer than a stated share of a model's tensors were found in the weights loaded into
    it; the message lists the missing keys and what the file holds."""


class CheckpointVoteError(RuntimeError):
    """A distributed save did not reach agreement: a rank died, stalled or failed. Raised on
    every rank; nothing was committed."""


class RankError(RuntimeError):
    """Another rank's error as its description (``Type: message``), carried by a collective
    that exchanges errors as pickles (DCP's save): an exception whose class cannot be pickled,
    or not rebuilt from its arguments, would fail the exchange itself and leave the other
    ranks waiting in it. The rank that raised it keeps and raises the original."""


class CheckpointNotShared(RuntimeError):
    """The checkpoint rank 0 chose is missing or different on another rank (raised on all)."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed in the filesystem (no space, quota, I/O error).

    An ``OSError`` with the cause's ``errno``, so ``except OSError`` and errno checks keep
    working; the message names the file and the cause, and for a full disk the space needed
    and free. Raised after the save removed what it had written: the previous checkpoint, its
    manifest and ``last_checkpoint`` are as they were.
    """

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno 28]" prefix
        return self.strerror or super().__str__()


class CheckpointLocationError(OSError):
    """A checkpoint location (an fsspec URL: ``s3://``, ``gs://``, ...) cannot be used: the
    bucket does not exist, the credentials are refused, the endpoint does not answer.

    Raised once, with a message naming the URL, the store's answer and what to do; for a save,
    after the save removed what it had staged: the previous checkpoint, its manifest and
    ``last_checkpoint`` are as they were.
    """

    def __str__(self) -> str:
        return self.strerror or super().__str__()
