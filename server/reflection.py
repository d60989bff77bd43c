"""gRPC server reflection under both of its names: grpc.reflection.v1 (what grpcurl
and current clients ask for first) and grpc.reflection.v1alpha.

grpcio-reflection implements only v1alpha. v1 is the same protocol (the same
messages, field for field, in another package), so one servicer answers both
names: the v1 method's bytes parse as the v1alpha messages. So that reflection can
also describe the v1 service itself, its file descriptor (v1alpha's, renamed into
the v1 package) is added to the pool reflection reads.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
SERVICE_NAMES = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)


def _register_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """The v1 reflection service's descriptor in `pool` (kept if already there)."""
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    file = descriptor_pb2.FileDescriptorProto()
    v1alpha.DESCRIPTOR.CopyToProto(file)
    old = f".{file.package}."
    file.name, file.package = V1_FILE, V1_PACKAGE
    file.ClearField("options")

    def renamed(type_name: str) -> str:
        if type_name.startswith(old):
            return f".{V1_PACKAGE}." + type_name[len(old) :]
        return type_name

    messages = list(file.message_type)
    while messages:
        message = messages.pop()
        messages.extend(message.nested_type)
        for f in message.field:
            if f.HasField("type_name"):  # proto2: assigning would mark it present
                f.type_name = renamed(f.type_name)
    for service in file.service:
        for method in service.method:
            method.input_type = renamed(method.input_type)
            method.output_type = renamed(method.output_type)
    pool.Add(file)


def served_pool() -> descriptor_pool.DescriptorPool:
    """Every served proto file in one pool of its own. The OIP stubs keep their
    descriptors out of protobuf's default pool (scripts/gen_proto.sh: tritonclient and
    kserve define the same `inference.*` names there), where reflection would look."""
    from grpc_health.v1 import health_pb2

    from expertd.v1 import expertd_pb2, inference_pb2

    pool = descriptor_pool.DescriptorPool()
    for module in (expertd_pb2, inference_pb2, health_pb2, v1alpha):
        pool.AddSerializedFile(module.DESCRIPTOR.serialized_pb)
    return pool


def enable(service_names, server: grpc.aio.Server) -> None:
    """Serve reflection for `service_names` (the reflection services are added) on
    `server` under both the v1 and the v1alpha name."""
    pool = served_pool()
    _register_v1_descriptor(pool)
    names = tuple(service_names) + SERVICE_NAMES
    servicer = reflection.aio.ReflectionServicer(names, pool=pool)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha.ServerReflectionRequest.FromString,
        response_serializer=v1alpha.ServerReflectionResponse.SerializeToString,
    )
    for name in SERVICE_NAMES:
        handlers = {"ServerReflectionInfo": handler}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
