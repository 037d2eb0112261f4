"""Errors of the Strata client: one class per gRPC status a caller branches on."""

from __future__ import annotations

from typing import Optional

import grpc


class StrataError(Exception):
    """Any error the service (or the connection to it) reported.

    ``code`` is the gRPC status code, ``reason`` the service's machine-readable reason
    (``quota-sandboxes``, ``node-memory``, ``not-found``, ...), ``field`` the request
    field an invalid argument names.
    """

    def __init__(
        self,
        message: str,
        *,
        code: Optional[grpc.StatusCode] = None,
        reason: Optional[str] = None,
        field: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason = reason
        self.field = field


class NotFound(StrataError):
    """No such sandbox, file or catalog entry (or not one of the caller's project)."""


class PermissionDenied(StrataError):
    """The caller's project may not do this (another backend, another namespace)."""


class Unauthenticated(StrataError):
    """No token, or a revoked or unknown one."""


class InvalidArgument(StrataError):
    """A request field is wrong; ``field`` names it."""


class QuotaExceeded(StrataError):
    """The project's quota or the node's capacity is full; retry after ``retry_after`` s."""

    def __init__(self, message: str, *, retry_after: float = 1.0, **kw) -> None:
        super().__init__(message, **kw)
        self.retry_after = retry_after


class Unavailable(StrataError):
    """The service cannot be reached (or its store is down); retrying may succeed."""


class AlreadyExists(StrataError):
    """It exists already (a project, a catalog version; a step ID used for another command)."""


class FailedPrecondition(StrataError):
    """Not in the state the call needs: a journal step that failed or was cut off (it is
    never run again; use a new step ID)."""


class Timeout(StrataError):
    """The call's deadline passed."""


_BY_CODE = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.DEADLINE_EXCEEDED: Timeout,
}


def from_rpc(e: grpc.RpcError) -> StrataError:
    """The matching :class:`StrataError` of a failed call."""
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    meta = {}
    try:
        for k, v in e.trailing_metadata() or ():
            meta[k] = v
    except Exception:  # noqa: BLE001 - some errors carry no metadata
        pass
    reason, field = meta.get("strata-reason"), meta.get("strata-field")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        try:
            retry = float(meta.get("retry-after", "1"))
        except ValueError:
            retry = 1.0
        return QuotaExceeded(details, retry_after=retry, code=code, reason=reason, field=field)
    cls = _BY_CODE.get(code, StrataError)
    # The call's own deadline, noticed by the service first: it answers CANCELLED
    # "Timeout expired" (tonic's timeout) when that reaches the client before the
    # client's own DEADLINE_EXCEEDED does, which happens on a loaded node.
    if code == grpc.StatusCode.CANCELLED and details == "Timeout expired":
        cls = Timeout
    return cls(details, code=code, reason=reason, field=field)
