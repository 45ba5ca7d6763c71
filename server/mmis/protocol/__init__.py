"""The P0 <-> P1 wire protocol: messages, typed errors, the codec and the schema rule.

A leaf package: it imports nothing else of mmis (enforced by import-linter).
"""

from mmis.protocol.codec import (
    REQUEST_STRUCTS,
    Frame,
    Request,
    WireCodec,
    decode,
    decode_outputs,
    decode_request,
    encode,
    encode_outputs,
    encode_request,
)
from mmis.protocol.errors import MMISError, MultiModalCacheMissError, ProtocolError
from mmis.protocol.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ErrorCode,
    FinishReason,
    MultiModalFeature,
    PlaceholderRange,
    PoolingParams,
    RequestError,
    RequestType,
    SamplingParams,
    ShmAddress,
    StructuredOutputs,
    TokenLogprobs,
    UtilityCall,
    UtilityResult,
)
from mmis.protocol.schema import WIRE_STRUCTS, check_append_only, describe_all
from mmis.protocol.tensors import INLINE_THRESHOLD, TENSOR_EXT_CODE, TensorHeader

__all__ = [
    "INLINE_THRESHOLD",
    "REQUEST_STRUCTS",
    "TENSOR_EXT_CODE",
    "WIRE_STRUCTS",
    "AbortRequests",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "ErrorCode",
    "FinishReason",
    "Frame",
    "MMISError",
    "MultiModalCacheMissError",
    "MultiModalFeature",
    "PlaceholderRange",
    "PoolingParams",
    "ProtocolError",
    "Request",
    "RequestError",
    "RequestType",
    "SamplingParams",
    "ShmAddress",
    "StructuredOutputs",
    "TensorHeader",
    "TokenLogprobs",
    "UtilityCall",
    "UtilityResult",
    "WireCodec",
    "check_append_only",
    "decode",
    "decode_outputs",
    "decode_request",
    "describe_all",
    "encode",
    "encode_outputs",
    "encode_request",
]
