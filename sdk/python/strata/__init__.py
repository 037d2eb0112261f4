"""Strata: layered, lazily loaded sandboxes for agent training and evaluation.

>>> import strata
>>> async with strata.AsyncClient("http://127.0.0.1:7600", token=TOKEN) as client:
...     async with await client.create("datasets/six", backend="container") as sb:
...         r = await sb.exec("python3 -m pytest -q")

:class:`Client` is the same API, synchronous.
"""

from .client import (
    AsyncClient,
    AsyncFiles,
    AsyncSandbox,
    Client,
    ExecEvent,
    ExecResult,
    FileEntry,
    Files,
    Process,
    Sandbox,
)
from .errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    StrataError,
    Timeout,
    Unauthenticated,
    Unavailable,
)

__all__ = [
    "AsyncClient",
    "AsyncFiles",
    "AsyncSandbox",
    "Client",
    "ExecEvent",
    "ExecResult",
    "FileEntry",
    "Files",
    "Process",
    "Sandbox",
    "StrataError",
    "NotFound",
    "PermissionDenied",
    "Unauthenticated",
    "InvalidArgument",
    "QuotaExceeded",
    "Unavailable",
    "Timeout",
    "AlreadyExists",
    "FailedPrecondition",
]
__version__ = "0.1.0"
