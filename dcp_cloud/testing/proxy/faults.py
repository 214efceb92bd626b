"""What the fault proxy injects: the fault kinds, :class:`FaultPlan`, the draw of a fault for a request,
the injected error answers, and :class:`FaultEvent`."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

#: Every kind of transient fault a :class:`FaultPlan` can inject (one a client retries), in the order they
#: are drawn.
FAULT_KINDS = ("slowdown", "throttle_429", "error_500", "reset", "truncate", "stall")
#: Kinds of permanent fault (one no retry gets past), drawn after :data:`FAULT_KINDS`: a ``403`` refusal.
PERMANENT_KINDS = ("denied_403",)
_DRAWN_KINDS = FAULT_KINDS + PERMANENT_KINDS
_ERROR_KINDS = ("slowdown", "throttle_429", "error_500", "denied_403")
_PHASES = ("request", "response", "either")
#: Bytes of a status line sent before a no-body "truncation": never a complete status code.
_STATUS_CUT = len("HTTP/1.1 2")


@dataclass(frozen=True)
class RequestInfo:
    """What a fault filter sees of a request."""

    method: str
    #: The path as sent, percent-encoding kept, query removed (``/bucket/key``).
    path: str
    query: str
    #: Request headers, names lower-cased.
    headers: Mapping[str, str]


@dataclass(frozen=True)
class FaultPlan:
    """Which faults to inject, how often, and on which requests.

    Each probability is per eligible request; their sum must be at most 1 (one
    fault at most per request). A request is eligible when it passes every
    filter given (``methods``, ``path_matches``, ``when``) and fewer than
    ``max_faults`` faults were decided so far. Draws come from
    ``random.Random(seed)``, so a run is reproducible for a given order of
    requests (with concurrent clients the order, hence the victims, may vary).
    """

    #: Throttling: S3 ``503 SlowDown`` (XML), or a GCS-style ``503`` JSON error.
    slowdown: float = 0.0
    #: ``429 Too Many Requests``.
    throttle_429: float = 0.0
    #: ``500 Internal Error``.
    error_500: float = 0.0
    #: Connection dropped with a TCP RST, without any (or without the whole) response.
    reset: float = 0.0
    #: Response headers (with the full Content-Length) then a FIN after part of the body.
    truncate: float = 0.0
    #: Nothing (more) is sent for ``stall_seconds``, then the connection is closed.
    stall: float = 0.0
    #: ``403 Forbidden`` (S3 ``AccessDenied``, GCS ``forbidden``, Azure ``AuthorizationPermissionMismatch``):
    #: a permanent refusal, as for a credential that lost its permission.
    denied_403: float = 0.0
    #: How long a stalled response is held; make it longer than the client's read timeout.
    stall_seconds: float = 5.0
    #: When resets and stalls strike: ``"request"`` (after reading the request,
    #: before forwarding it), ``"response"`` (after the upstream answered, mid-body)
    #: or ``"either"`` (a fair coin per fault).
    phase: Literal["request", "response", "either"] = "either"
    #: Seed of the fault RNG.
    seed: int = 0
    #: Only requests with these methods (upper-case) are eligible; ``None``: all.
    methods: frozenset[str] | None = None
    #: Only requests whose path passes this predicate are eligible; ``None``: all.
    path_matches: Callable[[str], bool] | None = None
    #: Only requests passing this predicate are eligible (e.g. ranged GETs:
    #: ``lambda r: "range" in r.headers``); ``None``: all.
    when: Callable[[RequestInfo], bool] | None = None
    #: Most faults to inject in total; ``None``: no cap.
    max_faults: int | None = None

    def __post_init__(self) -> None:
        for kind in _DRAWN_KINDS:
            p = getattr(self, kind)
            if not (isinstance(p, (int, float)) and 0.0 <= p <= 1.0):
                raise ValueError(f"{kind} must be a probability in [0, 1], got {p!r}")
        if self.total_rate > 1.0 + 1e-9:
            raise ValueError(f"fault probabilities add up to {self.total_rate:.3f} > 1")
        if not (math.isfinite(self.stall_seconds) and self.stall_seconds > 0):
            raise ValueError(f"stall_seconds must be positive and finite, got {self.stall_seconds!r}")
        if self.phase not in _PHASES:
            raise ValueError(f"phase must be one of {_PHASES}, got {self.phase!r}")
        if self.max_faults is not None and self.max_faults < 0:
            raise ValueError(f"max_faults must be >= 0 or None, got {self.max_faults}")
        if self.methods is not None:
            object.__setattr__(self, "methods", frozenset(m.upper() for m in self.methods))

    @classmethod
    def only(cls, kind: str, rate: float, **kwargs: object) -> FaultPlan:
        """A plan injecting one ``kind`` of fault with probability ``rate``."""
        if kind not in _DRAWN_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; expected one of {_DRAWN_KINDS}")
        return cls(**{kind: rate}, **kwargs)  # type: ignore[arg-type]

    @classmethod
    def every_kind(cls, rate: float, **kwargs: object) -> FaultPlan:
        """A plan injecting each transient kind of fault (:data:`FAULT_KINDS`) with probability ``rate``
        (``6 * rate`` in all)."""
        return cls(**{kind: rate for kind in FAULT_KINDS}, **kwargs)  # type: ignore[arg-type]

    @property
    def total_rate(self) -> float:
        """Probability that an eligible request gets some fault."""
        return float(sum(getattr(self, kind) for kind in _DRAWN_KINDS))

    def eligible(self, request: RequestInfo) -> bool:
        """Whether ``request`` passes the filters (``max_faults`` aside)."""
        if self.methods is not None and request.method not in self.methods:
            return False
        if self.path_matches is not None and not self.path_matches(request.path):
            return False
        return self.when is None or bool(self.when(request))


@dataclass(frozen=True)
class FaultEvent:
    """One injected fault (the most recent ones are kept in :attr:`ProxyStats.events`)."""

    kind: str
    method: str
    path: str
    #: ``"request"`` or ``"response"``: whether the upstream saw the request.
    phase: str


class _Fault:
    __slots__ = ("kind", "phase", "fraction")

    def __init__(self, kind: str, phase: str, fraction: float) -> None:
        self.kind = kind
        self.phase = phase
        self.fraction = fraction


def _draw_fault(plan: FaultPlan, rng: random.Random, decided: int, request: RequestInfo) -> _Fault | None:
    """The fault ``plan`` gives ``request``, if any, drawn from ``rng``; ``decided``: faults decided so far.

    The caller holds the lock that guards ``rng`` and counts a returned fault as decided.
    """
    if plan.total_rate <= 0.0:
        return None
    if plan.max_faults is not None and decided >= plan.max_faults:
        return None
    if not plan.eligible(request):
        return None
    u = rng.random()
    acc = 0.0
    for kind in _DRAWN_KINDS:
        acc += getattr(plan, kind)
        if u < acc:
            break
    else:
        return None
    phase = plan.phase if plan.phase != "either" else ("request" if rng.random() < 0.5 else "response")
    fraction = rng.random()
    return _Fault(kind, phase, fraction)


def azure_error_code(kind: str) -> str:
    """The ``x-ms-error-code`` of an injected error answer ``kind`` in Azure's shape."""
    return {
        "slowdown": "ServerBusy",
        "throttle_429": "TooManyRequests",
        "error_500": "InternalError",
        "denied_403": "AuthorizationPermissionMismatch",
    }[kind]


def _error_answer(kind: str, flavor: str, request_id: str) -> tuple[int, str, str, bytes]:
    """(status, reason, content type, body) of the injected error answer ``kind`` in the shape of ``flavor``."""
    status, reason = {
        "slowdown": (503, "Slow Down"),
        "throttle_429": (429, "Too Many Requests"),
        "error_500": (500, "Internal Server Error"),
        "denied_403": (403, "Forbidden"),
    }[kind]
    if flavor == "gcs":
        gcs_reason = {
            "slowdown": "backendError",
            "throttle_429": "rateLimitExceeded",
            "error_500": "backendError",
            "denied_403": "forbidden",
        }[kind]
        message = {
            "slowdown": "We encountered an internal error. Please try again.",
            "throttle_429": "The rate of change requests to the object is too high.",
            "error_500": "We encountered an internal error. Please try again.",
            "denied_403": "The caller does not have permission.",
        }[kind]
        error = {
            "code": status,
            "message": message,
            "errors": [{"message": message, "domain": "global", "reason": gcs_reason}],
        }
        body = json.dumps({"error": error}).encode()
        return status, reason, "application/json; charset=UTF-8", body
    if flavor == "azure":  # Azure Blob's throttling (503 ServerBusy) and server errors, as the service words them
        code, message = (
            azure_error_code(kind),
            {
                "slowdown": "The server is busy.",
                "throttle_429": "The request rate is too high.",
                "error_500": "Server encountered an internal error. Please try again after some time.",
                "denied_403": "This request is not authorized to perform this operation using this permission.",
            }[kind],
        )
        body = (
            '<?xml version="1.0" encoding="utf-8"?>'
            f"<Error><Code>{code}</Code><Message>{message}\nRequestId:{request_id}</Message></Error>"
        ).encode()
        return status, reason, "application/xml", body
    code, message = {
        "slowdown": ("SlowDown", "Please reduce your request rate."),
        "throttle_429": ("TooManyRequests", "Please reduce your request rate."),
        "error_500": ("InternalError", "We encountered an internal error. Please try again."),
        "denied_403": ("AccessDenied", "Access Denied"),
    }[kind]
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<RequestId>{request_id}</RequestId><HostId>faultproxy</HostId></Error>"
    ).encode()
    return status, reason, "application/xml", body
