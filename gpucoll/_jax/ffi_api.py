"""ctypes mirrors of XLA's C FFI structs (``xla/ffi/api/c_api.h``, FFI API version 0.3).

Field for field as in the header under ``jax.ffi.include_dir()``; :func:`check_sizes`
compares each struct's size with the header's ``XLA_FFI_STRUCT_SIZE`` rule (offset of the
last field plus its size) so that a layout drift is caught, not read as garbage.
"""

from __future__ import annotations

import ctypes as C

API_MAJOR = 0  # XLA_FFI_API_MAJOR in the header this mirrors
API_MINOR = 3  # XLA_FFI_API_MINOR

EXTENSION_METADATA = 1       # XLA_FFI_Extension_Metadata
STAGE_EXECUTE = 3            # XLA_FFI_ExecutionStage_EXECUTE
ATTR_SCALAR = 3              # XLA_FFI_AttrType_SCALAR
ATTR_STRING = 4              # XLA_FFI_AttrType_STRING
ERROR_INTERNAL = 13          # XLA_FFI_Error_Code_INTERNAL


class ExtensionBase(C.Structure):
    pass


ExtensionBase._fields_ = [("struct_size", C.c_size_t), ("type", C.c_int),
                          ("next", C.POINTER(ExtensionBase))]


class ApiVersion(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.POINTER(ExtensionBase)),
                ("major_version", C.c_int), ("minor_version", C.c_int)]


class Metadata(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("api_version", ApiVersion),
                ("traits", C.c_uint32), ("state_type_id", C.c_int64)]


class MetadataExtension(C.Structure):
    _fields_ = [("extension_base", ExtensionBase), ("metadata", C.POINTER(Metadata))]


class ErrorCreateArgs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.POINTER(ExtensionBase)),
                ("message", C.c_char_p), ("errc", C.c_int)]


ErrorCreate = C.CFUNCTYPE(C.c_void_p, C.POINTER(ErrorCreateArgs))


class StreamGetArgs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.POINTER(ExtensionBase)),
                ("ctx", C.c_void_p), ("stream", C.c_void_p)]


class DeviceOrdinalGetArgs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.POINTER(ExtensionBase)),
                ("ctx", C.c_void_p), ("device_ordinal", C.c_int32)]


StreamGet = C.CFUNCTYPE(C.c_void_p, C.POINTER(StreamGetArgs))
DeviceOrdinalGet = C.CFUNCTYPE(C.c_void_p, C.POINTER(DeviceOrdinalGetArgs))


class Api(C.Structure):
    # The functions gpucoll calls are typed; the others are opaque pointers, in order.
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.POINTER(ExtensionBase)),
                ("api_version", ApiVersion), ("internal_api", C.c_void_p),
                ("error_create", ErrorCreate),
                ("error_get_message", C.c_void_p), ("error_destroy", C.c_void_p),
                ("handler_register", C.c_void_p), ("stream_get", StreamGet),
                ("type_register", C.c_void_p), ("execution_context_get", C.c_void_p),
                ("state_set", C.c_void_p), ("state_get", C.c_void_p),
                ("device_memory_allocate", C.c_void_p), ("device_memory_free", C.c_void_p),
                ("thread_pool_schedule", C.c_void_p), ("thread_pool_num_threads", C.c_void_p),
                ("future_create", C.c_void_p), ("future_set_available", C.c_void_p),
                ("future_set_error", C.c_void_p), ("run_id_get", C.c_void_p),
                ("device_ordinal_get", DeviceOrdinalGet)]


class Buffer(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.POINTER(ExtensionBase)),
                ("dtype", C.c_int), ("data", C.c_void_p), ("rank", C.c_int64),
                ("dims", C.POINTER(C.c_int64))]


class ByteSpan(C.Structure):
    _fields_ = [("ptr", C.c_void_p), ("len", C.c_size_t)]


class Scalar(C.Structure):
    _fields_ = [("dtype", C.c_int), ("value", C.c_void_p)]


class Args(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.POINTER(ExtensionBase)),
                ("size", C.c_int64), ("types", C.POINTER(C.c_int)), ("args", C.POINTER(C.c_void_p))]


class Rets(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.POINTER(ExtensionBase)),
                ("size", C.c_int64), ("types", C.POINTER(C.c_int)), ("rets", C.POINTER(C.c_void_p))]


class Attrs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.POINTER(ExtensionBase)),
                ("size", C.c_int64), ("types", C.POINTER(C.c_int)),
                ("names", C.POINTER(C.POINTER(ByteSpan))), ("attrs", C.POINTER(C.c_void_p))]


class CallFrame(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.POINTER(ExtensionBase)),
                ("api", C.POINTER(Api)), ("ctx", C.c_void_p), ("stage", C.c_int),
                ("args", Args), ("rets", Rets), ("attrs", Attrs), ("future", C.c_void_p)]


Handler = C.CFUNCTYPE(C.c_void_p, C.POINTER(CallFrame))

# Each struct's XLA_FFI_STRUCT_SIZE as the header defines it (its last named field).
_LAST_FIELD = {ApiVersion: "minor_version", Metadata: "traits", ErrorCreateArgs: "errc",
               Buffer: "dims", Args: "args", Rets: "rets", Attrs: "attrs", CallFrame: "attrs",
               ExtensionBase: "next", StreamGetArgs: "stream", DeviceOrdinalGetArgs: "device_ordinal"}


def struct_size(cls: type[C.Structure]) -> int:
    field = getattr(cls, _LAST_FIELD[cls])
    return int(field.offset + field.size)


def check_sizes() -> dict[str, int]:
    """The header's STRUCT_SIZE of each mirrored struct (x86-64/aarch64 LP64 values pinned)."""
    expected = {"ApiVersion": 24, "Metadata": 36, "ErrorCreateArgs": 28, "Buffer": 48,
                "Args": 40, "Rets": 40, "Attrs": 48, "CallFrame": 168, "ExtensionBase": 24,
                "StreamGetArgs": 32, "DeviceOrdinalGetArgs": 28}
    # XLA_FFI_DeviceOrdinal_Get is the Api's 18th function after XLA_FFI_Error_Create
    if Api.device_ordinal_get.offset != Api.error_create.offset + 17 * C.sizeof(C.c_void_p):
        raise RuntimeError("XLA FFI Api mirror: its function table is out of order")
    got = {cls.__name__: struct_size(cls) for cls in _LAST_FIELD}
    if got != expected:
        raise RuntimeError(f"XLA FFI struct layout differs from c_api.h 0.3: {got} != {expected}")
    return got
