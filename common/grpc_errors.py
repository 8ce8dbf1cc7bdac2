"""Mapping of Tandem's typed errors to gRPC status codes."""

from __future__ import annotations

from typing import NoReturn

import grpc

from common.lenient_parse import Unparsable
from common.validation import InvalidArgument


async def abort_invalid(context: grpc.aio.ServicerContext, exc: InvalidArgument) -> NoReturn:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    raise AssertionError("unreachable")


def check_parsed(request: object) -> None:
    """Raise InvalidArgument for a request the lenient deserializer could not parse."""
    if isinstance(request, Unparsable):
        raise InvalidArgument(request.field, request.reason)
