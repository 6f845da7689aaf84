"""textgen's Python SDK: typed gRPC clients of `textgen.v1.TextGenerationService`.

    from textgen.sdk import Client
    with Client("127.0.0.1:50051", api_key="secret", timeout=30) as client:
        print(client.generate("Hello", max_new_tokens=20).generated_text)
        for message in client.generate_stream("Once upon a time", max_new_tokens=50):
            print(message.token.text, end="", flush=True)

`AsyncClient` has the same methods for asyncio. Keyword arguments follow TGI's
Python client; failures raise `TextGenError` subclasses. `textgen.sdk.http_streams`
streams the HTTP faces (TGI's `/generate_stream`, OpenAI's routes) with the standard
library and the same typed errors. The SDK needs grpcio,
protobuf, googleapis-common-protos and betterproto2 only (no torch, no transformers).
"""

from ._generated.textgen.v1 import (
    BestOfSequence,
    Details,
    GenerateParameters,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamResponse,
    Grammar,
    ImageInput,
    InfoResponse,
    Model,
    PrefillToken,
    SimpleToken,
    StreamDetails,
    Timings,
    Token,
)
from .client import AsyncClient, Client
from .errors import (
    DeadlineExceededError,
    GenerationError,
    IncompleteGenerationError,
    NotFoundError,
    OverloadedError,
    TextGenError,
    UnauthenticatedError,
    UnavailableError,
    UnknownError,
    ValidationError,
)
from .images import ImageLike, image_input
from .parameters import GenerateOptions, generate_parameters
from .retry import RetryPolicy

__all__ = [
    "AsyncClient",
    "BestOfSequence",
    "Client",
    "DeadlineExceededError",
    "Details",
    "GenerateOptions",
    "GenerateParameters",
    "GenerateRequest",
    "GenerateResponse",
    "GenerateStreamResponse",
    "GenerationError",
    "Grammar",
    "ImageInput",
    "ImageLike",
    "IncompleteGenerationError",
    "InfoResponse",
    "Model",
    "NotFoundError",
    "OverloadedError",
    "PrefillToken",
    "RetryPolicy",
    "SimpleToken",
    "StreamDetails",
    "TextGenError",
    "Timings",
    "Token",
    "UnauthenticatedError",
    "UnavailableError",
    "UnknownError",
    "ValidationError",
    "generate_parameters",
    "image_input",
]
