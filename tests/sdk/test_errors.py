"""The SDK's exception map (textgen.sdk.errors) against the error vocabulary
(textgen.service.errors.ErrorType).

The SDK imports nothing of the server, so its table of error types is its own; these
tests keep it in step: every error type the server answers with lands in the SDK class
whose gRPC code is that type's, and the SDK names no error type the vocabulary lacks.
"""

from __future__ import annotations

import grpc
import pytest
from textgen.sdk import errors as sdk_errors
from textgen.sdk.errors import TextGenError, UnknownError, from_rpc_error, from_stream_error
from textgen.service.errors import SERVER_ERROR_TYPES, ErrorType

# Error types only the SDK names, for failures seen on the client's side that no server
# or Envoy reply carries as an error_type: "deadline_exceeded" is a call whose own
# timeout ran out (DeadlineExceededError; Envoy's timeout is "timeout"), "unknown" the
# default of TextGenError and UnknownError, for a failure nothing typed.
SDK_ONLY_ERROR_TYPES = {"deadline_exceeded", "unknown"}

VOCABULARY = {error_type.value for error_type in ErrorType}


def sdk_error_classes() -> list[type[TextGenError]]:
    """TextGenError and every subclass of it that textgen.sdk.errors exports."""
    exported = [getattr(sdk_errors, name) for name in sdk_errors.__all__]
    return [cls for cls in exported if isinstance(cls, type) and issubclass(cls, TextGenError)]


class StatusOnly(grpc.RpcError):
    """A failed call that carries a status code and no ErrorInfo (a proxy's answer)."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "boom"

    def trailing_metadata(self) -> tuple[()]:
        return ()


@pytest.mark.parametrize("error_type", SERVER_ERROR_TYPES, ids=str)
def test_server_error_type_maps_to_class_of_its_grpc_code(error_type: ErrorType) -> None:
    error = from_stream_error("boom", error_type.value)
    assert type(error) is not UnknownError
    assert type(error).default_code == error_type.grpc_code
    assert (error.message, error.error_type, error.code) == (
        "boom",
        error_type.value,
        error_type.grpc_code,
    )


@pytest.mark.parametrize("error_type", SERVER_ERROR_TYPES, ids=str)
def test_server_grpc_code_alone_maps_to_the_same_class(error_type: ErrorType) -> None:
    error = from_rpc_error(StatusOnly(error_type.grpc_code))
    assert type(error) is type(from_stream_error("boom", error_type.value))
    assert error.code == error_type.grpc_code


def test_sdk_names_no_error_type_outside_the_vocabulary() -> None:
    assert SDK_ONLY_ERROR_TYPES.isdisjoint(VOCABULARY)  # else drop it from the exceptions
    named_by_classes = {cls.default_error_type for cls in sdk_error_classes()}
    assert named_by_classes - VOCABULARY <= SDK_ONLY_ERROR_TYPES
    # the reasons from_rpc_error and from_stream_error recognise
    assert set(sdk_errors._CLASS_BY_REASON) - VOCABULARY <= SDK_ONLY_ERROR_TYPES


def test_every_class_the_map_gives_is_checked() -> None:
    reachable = {*sdk_errors._CLASS_BY_REASON.values(), UnknownError, TextGenError}
    assert reachable <= set(sdk_error_classes())
