"""The typed error tree: each error has a code, an HTTP status, a retryable flag and a message.

Errors cross the bus as error frames (see :mod:`bus_schemas.frames`) and are mapped to
OpenAI-shaped HTTP errors by the bridge. A client never sees a traceback.
"""

from __future__ import annotations

from typing import Any, ClassVar


class TokenbusError(Exception):
    """Base of every error tokenbus reports to a caller."""

    code: ClassVar[str] = "internal_error"
    status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False
    type: ClassVar[str] = "server_error"

    def __init__(
        self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        # HTTP response headers that belong with this error (Retry-After, x-ratelimit-*).
        self.headers = dict(headers or {})

    def to_dict(self) -> dict[str, Any]:
        """The wire form used inside error frames."""
        return {
            "code": self.code,
            "status": self.status,
            "message": self.message,
            "retryable": self.retryable,
            "param": self.param,
            **({"headers": self.headers} if self.headers else {}),
        }

    def openai_body(self) -> dict[str, Any]:
        """OpenAI's error JSON shape."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TokenbusError:
        """Rebuild a typed error from its wire form (unknown codes keep their status)."""
        code = str(data.get("code", "internal_error"))
        klass = ERRORS_BY_CODE.get(
            code.split(".", 1)[0] if code.startswith(ContentBlocked.code + ".") else code
        )
        msg = str(data.get("message", "error"))
        param = data.get("param")
        if klass is not None:
            return klass(msg, param=param, headers=data.get("headers"))
        err = RemoteError(msg, param=param, headers=data.get("headers"))
        err.remote_code = code
        err.remote_status = int(data.get("status", 500))
        err.remote_retryable = bool(data.get("retryable", False))
        return err


class RemoteError(TokenbusError):
    """An error whose code this version does not know; keeps what the sender said."""

    remote_code: str = "internal_error"
    remote_status: int = 500
    remote_retryable: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d.update(code=self.remote_code, status=self.remote_status, retryable=self.remote_retryable)
        return d

    def openai_body(self) -> dict[str, Any]:
        body = super().openai_body()
        body["error"]["code"] = self.remote_code
        return body

    @property
    def http_status(self) -> int:
        return self.remote_status


class InvalidRequest(TokenbusError):
    """The request is malformed or has a wrong value; fix it and send again."""

    code = "invalid_request"
    status = 400
    type = "invalid_request_error"


def bad_field(param: str, message: str) -> InvalidRequest:
    """A 400 naming its field: ``<param>: <message>``."""
    return InvalidRequest(f"{param}: {message}", param=param)


def _union_member(part: Any) -> bool:
    """A step of a pydantic error's location that names the member of a union that failed
    (``str``, ``list[...]``), not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def _depth(error: Any) -> int:
    """How far into a value an error lies: its location's length."""
    return len(error.get("loc", ()))


def from_validation(exc: Any, *, union_members: bool = True) -> InvalidRequest:
    """A pydantic ``ValidationError`` as the 400 it is: its first problem, naming the field
    (the dotted path; a check across fields that says ``field: what is wrong`` names its
    field), and how many more there are. ``union_members=False``: the location leaves out
    the union member pydantic tried (``input.str`` is ``input``). Where a value fits no
    member of a union, the member that got furthest into it speaks (a list of content parts
    with one bad part is told about that part, not that it is not a string)."""
    errors = exc.errors()
    first = errors[0]
    if first.get("loc") and first["loc"][-1] in ("str", "int", "float", "bool"):
        first = max(errors, key=_depth)  # the first member found on the longest path
        first = first if _depth(first) > _depth(errors[0]) else errors[0]
    loc = ".".join(
        str(p)
        for p in first.get("loc", ())
        if not _union_member(p) or (union_members and "[" not in p)
    )
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    if not loc:
        field, sep, rest = msg.partition(": ")
        if sep and field.isidentifier():
            loc, msg = field, rest
    more = f" (and {exc.error_count() - 1} more problems)" if exc.error_count() > 1 else ""
    return InvalidRequest(f"{loc or 'body'}: {msg}{more}", param=loc or None)


class InvalidJSON(InvalidRequest):
    code = "invalid_json"


class ContentBlocked(InvalidRequest):
    """The content filter refused the input (or ended the output) for a named detector."""

    code = "content_blocked"

    def __init__(
        self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message, param=param, headers=headers)
        self.detector = param or "unknown"

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["code"] = f"content_blocked.{self.detector}"
        return d

    def openai_body(self) -> dict[str, Any]:
        body = super().openai_body()
        body["error"]["code"] = f"content_blocked.{self.detector}"
        return body


class ContextLengthExceeded(InvalidRequest):
    """The prompt and ``max_tokens`` cannot fit the model's context, in vLLM's words."""

    code = "context_length_exceeded"

    @classmethod
    def of(cls, limit: int, completion: int, prompt: int | None = None) -> ContextLengthExceeded:
        """The error for ``completion`` tokens asked after ``prompt`` (None: not counted)."""
        if prompt is None:  # the prompt is not counted here: the completion alone is too long
            asked = f"{completion} tokens in the completion alone"
        else:
            asked = (
                f"{prompt + completion} tokens ({prompt} in the messages, {completion} in "
                "the completion)"
            )
        return cls(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{asked}. Please reduce the length of the messages or completion.",
            param="messages" if prompt is not None and prompt >= limit else "max_tokens",
        )


class TokensExceedLimit(InvalidRequest):
    """One request needs more tokens than its key may use in a whole minute: no wait makes
    room for it, so it is a 400 (OpenAI answers 429 here, which clients retry in vain)."""

    code = "tokens_exceed_limit"

    @classmethod
    def of(cls, limit: int, requested: int) -> TokensExceedLimit:
        return cls(
            f"Request too large for this key on tokens per minute (TPM): Limit {limit}, "
            f"Requested {requested} (the prompt, about four characters a token, plus "
            "max_tokens). The input or output tokens must be reduced in order to run "
            "successfully.",
            param="max_tokens",
        )


class PayloadTooLarge(InvalidRequest):
    code = "payload_too_large"
    status = 413


class RequestTimeout(InvalidRequest):
    """The request did not arrive in time (a body shorter than its Content-Length, or one
    sent too slowly); the connection is closed."""

    code = "request_timeout"
    status = 408


class HeaderFieldsTooLarge(InvalidRequest):
    """The request line and headers are larger than the bridge takes; the connection is
    closed. Only the HTTP layer raises it: it never crosses the bus."""

    code = "request_header_fields_too_large"
    status = 431


class Unauthorized(TokenbusError):
    code = "invalid_api_key"
    status = 401
    type = "authentication_error"


class Forbidden(TokenbusError):
    code = "model_not_allowed"
    status = 403
    type = "permission_error"


class InsufficientPermissions(Forbidden):
    """A valid key that may not do this at all (a key without the admin flag on the admin
    API), in OpenAI's words for a key lacking a permission."""

    code = "insufficient_permissions"


class ModelNotFound(TokenbusError):
    code = "model_not_found"
    status = 404
    type = "invalid_request_error"


class NotFound(TokenbusError):
    code = "not_found"
    status = 404
    type = "invalid_request_error"


class RateLimited(TokenbusError):
    code = "rate_limit_exceeded"
    status = 429
    retryable = True
    type = "rate_limit_error"


class InsufficientQuota(TokenbusError):
    """The key (or its owner) has spent its budget for the period: OpenAI's answer when an
    account is out of credit. Not retryable before the period ends or the budget grows."""

    code = "insufficient_quota"
    status = 429
    type = "insufficient_quota"


class TooManyConnections(RateLimited):
    """The client holds more connections to the bridge than it may; the connection is
    closed. Only the HTTP layer raises it: it never crosses the bus."""

    code = "too_many_connections"


class NoReplica(TokenbusError):
    """No live replica serves the model right now."""

    code = "no_replica"
    status = 503
    retryable = True


class Overloaded(TokenbusError):
    """Every replica of the model is at capacity and the router's queue is full or waited
    too long: back off and retry."""

    code = "overloaded"
    status = 503
    retryable = True


class ReplicaBusy(TokenbusError):
    """This replica is at its concurrency limit (another one may take the request)."""

    code = "replica_busy"
    status = 503
    retryable = True


class ServiceUnavailable(TokenbusError):
    """A pipeline stage is not running or not reachable."""

    code = "service_unavailable"
    status = 503
    retryable = True


class ReplicaDraining(TokenbusError):
    code = "replica_draining"
    status = 503
    retryable = True


class ReplicaLost(TokenbusError):
    """The replica serving the stream went away before it finished."""

    code = "replica_lost"
    status = 503
    retryable = True


class Timeout(TokenbusError):
    code = "timeout"
    status = 504
    retryable = True


class Cancelled(TokenbusError):
    code = "cancelled"
    status = 499
    type = "invalid_request_error"


class EngineError(TokenbusError):
    code = "engine_error"
    status = 502
    retryable = True


class InternalError(TokenbusError):
    code = "internal_error"
    status = 500


class StorageFull(TokenbusError):
    """A store (files, batches) reached its configured size bound."""

    code = "storage_full"
    status = 507


ERRORS_BY_CODE: dict[str, type[TokenbusError]] = {
    k.code: k
    for k in (
        InvalidRequest,
        InvalidJSON,
        ContentBlocked,
        ContextLengthExceeded,
        TokensExceedLimit,
        PayloadTooLarge,
        Unauthorized,
        Forbidden,
        InsufficientPermissions,
        ModelNotFound,
        NotFound,
        RateLimited,
        InsufficientQuota,
        NoReplica,
        Overloaded,
        ReplicaBusy,
        ServiceUnavailable,
        StorageFull,
        ReplicaDraining,
        ReplicaLost,
        Timeout,
        Cancelled,
        EngineError,
        InternalError,
    )
}


def http_status(err: TokenbusError) -> int:
    """The HTTP status for an error, honouring statuses of codes this version does not know."""
    return err.http_status if isinstance(err, RemoteError) else err.status
