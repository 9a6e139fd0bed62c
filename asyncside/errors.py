"""The exceptions asyncside raises. Every message names the file, field or value at fault."""

from __future__ import annotations


class AsyncsideError(Exception):
    """Base class of every error asyncside raises on purpose."""


def os_reason(exc: OSError) -> str:
    """What an operating-system call's failure says, as the errors here quote it: its reason and
    errno ("Permission denied (errno 13)")."""
    return f"{exc.strerror or exc} (errno {exc.errno})"


class StoreError(AsyncsideError, ValueError):
    """An expert store is missing, malformed or hostile.

    ``path`` is the file at fault and ``field`` the manifest field (dotted, e.g.
    ``layers[3].segments[1].nbytes``) when one is to blame; ``errno`` is set when an operating
    system call on the file failed (e.g. a blob that cannot be opened).
    """

    def __init__(self, path: object, message: str, field: str | None = None, errno: int | None = None) -> None:
        self.path = str(path)
        self.field = field
        self.errno = errno
        where = f"{self.path}" + (f" [{field}]" if field else "")
        super().__init__(f"{where}: {message}")


class LedgerError(AsyncsideError, ValueError):
    """Bad input to a ledger (an id out of range, a wrong dtype) or an illegal transition."""


class CapacityError(AsyncsideError):
    """A demand needs more side-region rows than the layer has."""


class FillError(AsyncsideError):
    """Reading one expert record into its pool row failed; the row went back to the free list.

    A record whose bytes do not match its checksum fails with ``errno`` EBADMSG and the two
    checksums in ``expected`` and ``got``. ``step`` is the queued step whose forward read the
    record (the id its ``begin_step`` returned), None where that is not known (a host fill, or a
    queued fault the runtime could not place).
    """

    def __init__(self, layer: int, expert: int, row: int, message: str, errno: int | None = None,
                 expected: int | None = None, got: int | None = None, *, step: int | None = None) -> None:
        self.layer = layer
        self.expert = expert
        self.row = row
        self.errno = errno
        self.expected = expected
        self.got = got
        self.step = step
        super().__init__(f"layer {layer} expert {expert} (row {row}): {message}")


class MissingExtraError(AsyncsideError, ImportError):
    """A command needs a package that only an optional extra installs (``pip install 'asyncside[extra]'``).

    ``module`` is the missing import, ``extra`` the extra that installs it.
    """

    def __init__(self, module: str, extra: str, what: str) -> None:
        self.module = module
        self.extra = extra
        super().__init__(f"{what} needs {module}, which is not installed: pip install 'asyncside[{extra}]'",
                         name=module)


class TraceError(StoreError):
    """A routing trace (asyncside.routing) is missing, malformed or inconsistent.

    Like :class:`StoreError`: ``path`` is the file at fault (``<in memory>`` for a trace built in
    code) and ``field`` the field to blame (``ids``, ``lengths``, ``n_experts``, ``meta``).
    """


class ModelNotFoundError(AsyncsideError, FileNotFoundError):
    """A model named by the user (a directory or a Hugging Face repo id) cannot be found.

    ``model`` is the name as given; the message says where it was looked for.
    """

    def __init__(self, model: str, message: str) -> None:
        self.model = model
        super().__init__(f"{model}: {message}")


class EnvVarError(AsyncsideError, ValueError):
    """An ``ASYNCSIDE_*`` environment variable holds a value asyncside does not accept.

    ``variable``, ``value`` and ``expected`` (what is accepted, in words) are in the message too.
    """

    def __init__(self, variable: str, value: str, expected: str) -> None:
        self.variable, self.value, self.expected = variable, value, expected
        super().__init__(f"{variable}: expected {expected}, got {value!r}")
