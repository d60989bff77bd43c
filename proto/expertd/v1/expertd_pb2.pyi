from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    BF16: _ClassVar[DType]
    FP32: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    FP16: _ClassVar[DType]
    UINT8: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
BF16: DType
FP32: DType
INT32: DType
INT64: DType
FP16: DType
UINT8: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("layer", "hidden_states", "topk_ids", "topk_weights", "request_id", "trace_id", "instance_id", "timeout_us", "traceparent")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    hidden_states: Tensor
    topk_ids: Tensor
    topk_weights: Tensor
    request_id: int
    trace_id: str
    instance_id: str
    timeout_us: int
    traceparent: str
    def __init__(self, layer: _Optional[int] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., topk_ids: _Optional[_Union[Tensor, _Mapping]] = ..., topk_weights: _Optional[_Union[Tensor, _Mapping]] = ..., request_id: _Optional[int] = ..., trace_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., timeout_us: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_us", "compute_us", "total_us", "stage_us", "device_us", "batch_requests", "batch_tokens")
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    TOTAL_US_FIELD_NUMBER: _ClassVar[int]
    STAGE_US_FIELD_NUMBER: _ClassVar[int]
    DEVICE_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    queue_us: int
    compute_us: int
    total_us: int
    stage_us: int
    device_us: int
    batch_requests: int
    batch_tokens: int
    def __init__(self, queue_us: _Optional[int] = ..., compute_us: _Optional[int] = ..., total_us: _Optional[int] = ..., stage_us: _Optional[int] = ..., device_us: _Optional[int] = ..., batch_requests: _Optional[int] = ..., batch_tokens: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("request_id", "output", "error", "timing")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    output: Tensor
    error: Error
    timing: Timing
    def __init__(self, request_id: _Optional[int] = ..., output: _Optional[_Union[Tensor, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("version", "backend", "device", "hidden_size", "intermediate_size", "num_experts", "top_k", "layers", "experts", "weight_dtype", "activation_dtype", "output_dtype", "model", "instance_id", "max_tokens_per_request", "max_message_bytes", "shard_index", "num_shards", "dataplanes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_DTYPE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    DATAPLANES_FIELD_NUMBER: _ClassVar[int]
    version: str
    backend: str
    device: str
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    experts: _containers.RepeatedScalarFieldContainer[int]
    weight_dtype: str
    activation_dtype: DType
    output_dtype: DType
    model: str
    instance_id: str
    max_tokens_per_request: int
    max_message_bytes: int
    shard_index: int
    num_shards: int
    dataplanes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[str] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., hidden_size: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., num_experts: _Optional[int] = ..., top_k: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., experts: _Optional[_Iterable[int]] = ..., weight_dtype: _Optional[str] = ..., activation_dtype: _Optional[_Union[DType, str]] = ..., output_dtype: _Optional[_Union[DType, str]] = ..., model: _Optional[str] = ..., instance_id: _Optional[str] = ..., max_tokens_per_request: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., dataplanes: _Optional[_Iterable[str]] = ...) -> None: ...

class CudaBuffer(_message.Message):
    __slots__ = ("ipc_handle", "byte_size", "device_uuid")
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    ipc_handle: bytes
    byte_size: int
    device_uuid: str
    def __init__(self, ipc_handle: _Optional[bytes] = ..., byte_size: _Optional[int] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class NixlRegion(_message.Message):
    __slots__ = ("address", "byte_size", "device_id", "memory")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    address: int
    byte_size: int
    device_id: int
    memory: str
    def __init__(self, address: _Optional[int] = ..., byte_size: _Optional[int] = ..., device_id: _Optional[int] = ..., memory: _Optional[str] = ...) -> None: ...

class NixlPeer(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "regions")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    regions: _containers.RepeatedCompositeFieldContainer[NixlRegion]
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., regions: _Optional[_Iterable[_Union[NixlRegion, _Mapping]]] = ...) -> None: ...

class RegisterSlotsRequest(_message.Message):
    __slots__ = ("transport", "slots", "max_tokens", "top_k", "cuda_buffers", "nixl", "instance_id", "activation_dtype")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    CUDA_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_DTYPE_FIELD_NUMBER: _ClassVar[int]
    transport: str
    slots: int
    max_tokens: int
    top_k: int
    cuda_buffers: _containers.RepeatedCompositeFieldContainer[CudaBuffer]
    nixl: NixlPeer
    instance_id: str
    activation_dtype: DType
    def __init__(self, transport: _Optional[str] = ..., slots: _Optional[int] = ..., max_tokens: _Optional[int] = ..., top_k: _Optional[int] = ..., cuda_buffers: _Optional[_Iterable[_Union[CudaBuffer, _Mapping]]] = ..., nixl: _Optional[_Union[NixlPeer, _Mapping]] = ..., instance_id: _Optional[str] = ..., activation_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class SlotLayout(_message.Message):
    __slots__ = ("control_offset", "control_bytes", "x_offset", "ids_offset", "weights_offset", "out_offset", "byte_size", "max_tokens", "top_k", "hidden_size")
    CONTROL_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CONTROL_BYTES_FIELD_NUMBER: _ClassVar[int]
    X_OFFSET_FIELD_NUMBER: _ClassVar[int]
    IDS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    OUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    control_offset: int
    control_bytes: int
    x_offset: int
    ids_offset: int
    weights_offset: int
    out_offset: int
    byte_size: int
    max_tokens: int
    top_k: int
    hidden_size: int
    def __init__(self, control_offset: _Optional[int] = ..., control_bytes: _Optional[int] = ..., x_offset: _Optional[int] = ..., ids_offset: _Optional[int] = ..., weights_offset: _Optional[int] = ..., out_offset: _Optional[int] = ..., byte_size: _Optional[int] = ..., max_tokens: _Optional[int] = ..., top_k: _Optional[int] = ..., hidden_size: _Optional[int] = ...) -> None: ...

class RegisterSlotsResponse(_message.Message):
    __slots__ = ("socket_name", "token", "lease_id", "layout", "instance_id", "slots", "nixl", "data_port", "wake_port", "wake_token")
    SOCKET_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    WAKE_PORT_FIELD_NUMBER: _ClassVar[int]
    WAKE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    socket_name: str
    token: bytes
    lease_id: str
    layout: SlotLayout
    instance_id: str
    slots: int
    nixl: NixlPeer
    data_port: int
    wake_port: int
    wake_token: bytes
    def __init__(self, socket_name: _Optional[str] = ..., token: _Optional[bytes] = ..., lease_id: _Optional[str] = ..., layout: _Optional[_Union[SlotLayout, _Mapping]] = ..., instance_id: _Optional[str] = ..., slots: _Optional[int] = ..., nixl: _Optional[_Union[NixlPeer, _Mapping]] = ..., data_port: _Optional[int] = ..., wake_port: _Optional[int] = ..., wake_token: _Optional[bytes] = ...) -> None: ...
