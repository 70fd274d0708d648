"""Why the async engine could not serve a request, when the request itself is fine: each error carries
the HTTP status a server answers with (entrypoints/api_server.py); and the errors of a request's
grammar compile, raised in the engine core and answered in the front end."""

from __future__ import annotations


class RequestFailedError(RuntimeError):
    """A request the engine could not serve for a reason of the server's, not of the request:
    `status` is the HTTP status a server answers with."""

    status = 503


class EngineDeadError(RequestFailedError):
    """The engine stopped (shut down or crashed); no request can be served."""


class EngineOverloadedError(RequestFailedError):
    """Refused at once: the queue of waiting requests is full. Try again after `retry_after` s."""

    status = 429

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def __reduce__(self):
        return type(self), (str(self), self.retry_after)


class RequestTimeoutError(RequestFailedError):
    """The request's deadline passed before it finished; it was aborted."""

    status = 504


# (a request's errors cross from the engine core to the front end pickled: their classes live here,
# importable without torch, so that unpickling one loads no engine code into the server process)
class GrammarTooComplex(ValueError):
    """A constraint's grammar did not compile within the time budget or the memory limit."""


class CompileAborted(ValueError):
    """The request went away while its grammar compiled."""
