"""Failures behind the router as clients see them: OpenAI's error shape, a stable code,
a short message and the request's id, never what went wrong inside.

Ray's errors name actor ids, process ids, node addresses and advice about the OOM
killer; none of that helps a client, and some of it should not leave the server. The
details go to the server log under the request id the client got, so an operator can
find them from a client's report.
"""

from __future__ import annotations

import logging

from ray.exceptions import RayActorError

from cluster.openai_protocol import APIError
from scheduler.global_scheduler import NoWorkersError, OverloadedError

log = logging.getLogger("cluster.requests")

REQUEST_ID_HEADER = "x-request-id"


def client_error(e: BaseException, request_id: str) -> APIError:
    """``e`` as the client sees it: a refusal the router or scheduler worded for clients
    passes as it is; a failure of the cluster is a 503 ``unavailable``, anything else a
    500 ``internal_error``, both logged in full under ``request_id``."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, OverloadedError):
        return APIError(503, str(e), type="server_error", code="overloaded", retry_after_s=1)
    if isinstance(e, (NoWorkersError, RayActorError)):
        log.error("request %s: the cluster could not serve it: %s", request_id, e)
        return APIError(503, f"the cluster cannot serve requests now; retry in a few seconds "
                        f"(request id {request_id})", type="server_error", code="unavailable",
                        retry_after_s=5)
    if isinstance(e, ValueError):   # the scheduler's refusal of a request's values
        return APIError.bad_value(e)
    log.error("request %s failed", request_id, exc_info=e)
    return APIError(500, f"the server failed on this request (request id {request_id}); "
                    "report the id to its operator", type="server_error", code="internal_error")


def unavailable(what: str, e: BaseException) -> str:
    """The reason ``/health`` or ``/metrics`` gives when the scheduler does not answer;
    the details go to the log."""
    log.warning("%s: the scheduler does not answer: %s", what, e)
    return "the scheduler does not answer"
