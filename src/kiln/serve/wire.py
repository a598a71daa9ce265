"""Triton's gRPC messages, built and read directly (tritonclient's generated protocol on a ``grpc.aio`` channel).

Shared by ``kiln bench`` and kiln's OpenAI server. tritonclient's asyncio ``stream_infer`` refuses
``triton_``-prefixed request parameters, and decoupled models may end a request with a flags-only response that
only ``triton_enable_empty_final_response`` turns into something a client sees (an empty response marked
``triton_final_response``), so requests are built as ``service_pb2.ModelInferRequest`` messages here; the wire
format is exactly tritonclient's.
"""

from __future__ import annotations

from typing import Any

#: gRPC message size limit (tritonclient's).
MAX_GRPC_MESSAGE_SIZE = 2**31 - 1
#: Request parameter asking Triton to send an empty response for a flags-only final response.
EMPTY_FINAL_PARAM = "triton_enable_empty_final_response"
FINAL_PARAM = "triton_final_response"
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
                ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE)]


def add_input(req: Any, name: str, arr: Any, dtype: str, batched: bool) -> None:
    """Append input ``name`` (a numpy array without the batch dimension) to a ``ModelInferRequest``."""
    from tritonclient.utils import serialize_byte_tensor

    if batched:
        arr = arr.reshape((1,) + arr.shape)
    tensor = req.inputs.add()
    tensor.name = name
    tensor.datatype = dtype
    tensor.shape.extend(arr.shape)
    if dtype == "BYTES":
        raw = serialize_byte_tensor(arr)  # a 0-d object array holding the serialized bytes
        req.raw_input_contents.append(raw.item() if raw.size > 0 else b"")
    else:
        req.raw_input_contents.append(arr.tobytes())


_PACK = {"BOOL": "<?", "INT32": "<i", "INT64": "<q", "UINT64": "<Q", "FP32": "<f"}


def add_scalar_input(req: Any, name: str, value: Any, dtype: str, batched: bool) -> None:
    """Append a one-element input (``[1]``, or ``[1, 1]`` with a batch dimension) without numpy; a BYTES value
    is a ``bytes`` object, or a list of them (shape ``[n]``)."""
    import struct

    tensor = req.inputs.add()
    tensor.name = name
    tensor.datatype = dtype
    if dtype == "BYTES":
        items = value if isinstance(value, list) else [value]
        tensor.shape.extend(([1] if batched else []) + [len(items)])
        req.raw_input_contents.append(b"".join(struct.pack("<I", len(b)) + b for b in items))
        return
    tensor.shape.extend([1, 1] if batched else [1])
    req.raw_input_contents.append(struct.pack(_PACK[dtype], value))


def raw_int32_sum(resp: Any, index: int) -> int:
    """The sum of an INT32 output (raw contents) without numpy."""
    import struct

    if index < len(resp.raw_output_contents):
        return sum(v for (v,) in struct.iter_unpack("<i", resp.raw_output_contents[index]))
    return int(sum(resp.outputs[index].contents.int_contents))


def raw_fp32_list(resp: Any, index: int) -> list[float]:
    """An FP32 output's values (raw contents) without numpy."""
    from array import array

    if index < len(resp.raw_output_contents):
        values = array("f")
        values.frombytes(resp.raw_output_contents[index])
        return values.tolist()
    return list(resp.outputs[index].contents.fp32_contents)


def join_bytes_tensor(raw: bytes) -> bytes:
    """The elements of a serialized BYTES tensor (each a 4-byte little-endian length, then the bytes), joined."""
    parts = []
    i, n = 0, len(raw)
    while i + 4 <= n:
        size = int.from_bytes(raw[i : i + 4], "little")
        parts.append(raw[i + 4 : i + 4 + size])
        i += 4 + size
    return b"".join(parts)


def is_final(resp: Any) -> bool:
    """Whether a ``ModelInferResponse`` is the last one of its request."""
    param = resp.parameters.get(FINAL_PARAM)
    return bool(param is not None and param.bool_param)


def output_bytes(resp: Any, index: int) -> bytes:
    """Output ``index`` (a BYTES tensor) of a response, its elements joined."""
    if index < len(resp.raw_output_contents):
        return join_bytes_tensor(resp.raw_output_contents[index])
    return b"".join(resp.outputs[index].contents.bytes_contents)  # typed contents (unusual for Triton's server)
