"""Assemble the grpc.aio server: our service, the standard health service and
server reflection, on one port."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from textgen.sdk.keepalive import DEFAULT_KEEPALIVE, Keepalive

from ..proto import text_generation_service_pb2 as svc_pb
from ..proto import text_generation_service_pb2_grpc as svc_grpc
from .servicer import TextGenerationServicer

SERVICE_NAME = svc_pb.DESCRIPTOR.services_by_name["TextGenerationService"].full_name

# Prompts of a few hundred thousand characters must fit; TGI's HTTP limit is 2 MB.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


def build_server(
    servicer: TextGenerationServicer,
    address: str,
    interceptors: list | None = None,
    keepalive: Keepalive = DEFAULT_KEEPALIVE,
) -> tuple[grpc.aio.Server, health.HealthServicer, int]:
    """Returns the server (not started), its health servicer and the bound port. It
    accepts the pings of clients (its Envoy, the SDK) that follow `keepalive`."""
    server = grpc.aio.server(
        interceptors=interceptors or None,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            *keepalive.server_options(),
        ],
    )
    svc_grpc.add_TextGenerationServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return server, health_servicer, port


async def set_serving(health_servicer, serving: bool) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, status)
