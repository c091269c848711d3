from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProgramKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROGRAM_KIND_UNSPECIFIED: _ClassVar[ProgramKind]
    PROGRAM_KIND_ENGINE_KERNEL: _ClassVar[ProgramKind]
    PROGRAM_KIND_RAW_LLVM: _ClassVar[ProgramKind]
PROGRAM_KIND_UNSPECIFIED: ProgramKind
PROGRAM_KIND_ENGINE_KERNEL: ProgramKind
PROGRAM_KIND_RAW_LLVM: ProgramKind

class PingRequest(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class PingReply(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class WhoAmIRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WhoAmIReply(_message.Message):
    __slots__ = ("identity", "role", "fingerprint")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    identity: str
    role: str
    fingerprint: str
    def __init__(self, identity: _Optional[str] = ..., role: _Optional[str] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("name", "detail")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    name: str
    detail: str
    def __init__(self, name: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class ListDevicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDevicesReply(_message.Message):
    __slots__ = ("devices", "node_boot")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    NODE_BOOT_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceInfo]
    node_boot: bytes
    def __init__(self, devices: _Optional[_Iterable[_Union[DeviceInfo, _Mapping]]] = ..., node_boot: _Optional[bytes] = ...) -> None: ...

class PciFunctionInfo(_message.Message):
    __slots__ = ("address", "vendor_id", "device_id", "bars")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VENDOR_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    BARS_FIELD_NUMBER: _ClassVar[int]
    address: str
    vendor_id: int
    device_id: int
    bars: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, address: _Optional[str] = ..., vendor_id: _Optional[int] = ..., device_id: _Optional[int] = ..., bars: _Optional[_Iterable[int]] = ...) -> None: ...

class ListPciFunctionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPciFunctionsReply(_message.Message):
    __slots__ = ("functions",)
    FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    functions: _containers.RepeatedCompositeFieldContainer[PciFunctionInfo]
    def __init__(self, functions: _Optional[_Iterable[_Union[PciFunctionInfo, _Mapping]]] = ...) -> None: ...

class OpenLeaseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: bytes
    def __init__(self, lease: _Optional[bytes] = ...) -> None: ...

class LeaseReply(_message.Message):
    __slots__ = ("lease", "ttl_seconds")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease: bytes
    ttl_seconds: float
    def __init__(self, lease: _Optional[bytes] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class CloseLeaseRequest(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: bytes
    def __init__(self, lease: _Optional[bytes] = ...) -> None: ...

class CloseLeaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("lease", "device", "nbytes")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    lease: bytes
    device: str
    nbytes: int
    def __init__(self, lease: _Optional[bytes] = ..., device: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class AllocateReply(_message.Message):
    __slots__ = ("handle", "nbytes")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    nbytes: int
    def __init__(self, handle: _Optional[bytes] = ..., nbytes: _Optional[int] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("lease", "handle")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    lease: bytes
    handle: bytes
    def __init__(self, lease: _Optional[bytes] = ..., handle: _Optional[bytes] = ...) -> None: ...

class FreeReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WriteRequest(_message.Message):
    __slots__ = ("lease", "handle", "offset", "data")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    lease: bytes
    handle: bytes
    offset: int
    data: bytes
    def __init__(self, lease: _Optional[bytes] = ..., handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WriteReply(_message.Message):
    __slots__ = ("written",)
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    written: int
    def __init__(self, written: _Optional[int] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("lease", "handle", "offset", "length", "chunk_bytes")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    lease: bytes
    handle: bytes
    offset: int
    length: int
    chunk_bytes: int
    def __init__(self, lease: _Optional[bytes] = ..., handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class ReadReply(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class CopyRequest(_message.Message):
    __slots__ = ("lease", "dst", "dst_offset", "src", "src_offset", "length")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    DST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    SRC_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    lease: bytes
    dst: bytes
    dst_offset: int
    src: bytes
    src_offset: int
    length: int
    def __init__(self, lease: _Optional[bytes] = ..., dst: _Optional[bytes] = ..., dst_offset: _Optional[int] = ..., src: _Optional[bytes] = ..., src_offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class CopyReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadProgramRequest(_message.Message):
    __slots__ = ("device", "kind", "llvm_ir", "entry", "signature", "lease")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LLVM_IR_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    device: str
    kind: ProgramKind
    llvm_ir: str
    entry: str
    signature: _containers.RepeatedScalarFieldContainer[str]
    lease: bytes
    def __init__(self, device: _Optional[str] = ..., kind: _Optional[_Union[ProgramKind, str]] = ..., llvm_ir: _Optional[str] = ..., entry: _Optional[str] = ..., signature: _Optional[_Iterable[str]] = ..., lease: _Optional[bytes] = ...) -> None: ...

class LoadProgramReply(_message.Message):
    __slots__ = ("program_id",)
    PROGRAM_ID_FIELD_NUMBER: _ClassVar[int]
    program_id: str
    def __init__(self, program_id: _Optional[str] = ...) -> None: ...

class BufferArg(_message.Message):
    __slots__ = ("handle", "offset", "length")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    offset: int
    length: int
    def __init__(self, handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class LaunchArg(_message.Message):
    __slots__ = ("buffer", "i64", "f64", "f32")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    I64_FIELD_NUMBER: _ClassVar[int]
    F64_FIELD_NUMBER: _ClassVar[int]
    F32_FIELD_NUMBER: _ClassVar[int]
    buffer: BufferArg
    i64: int
    f64: float
    f32: float
    def __init__(self, buffer: _Optional[_Union[BufferArg, _Mapping]] = ..., i64: _Optional[int] = ..., f64: _Optional[float] = ..., f32: _Optional[float] = ...) -> None: ...

class LaunchRequest(_message.Message):
    __slots__ = ("lease", "device", "program_id", "args")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_ID_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    lease: bytes
    device: str
    program_id: str
    args: _containers.RepeatedCompositeFieldContainer[LaunchArg]
    def __init__(self, lease: _Optional[bytes] = ..., device: _Optional[str] = ..., program_id: _Optional[str] = ..., args: _Optional[_Iterable[_Union[LaunchArg, _Mapping]]] = ...) -> None: ...

class LaunchReply(_message.Message):
    __slots__ = ("seconds",)
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    def __init__(self, seconds: _Optional[float] = ...) -> None: ...

class MintElevationTokenRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MintElevationTokenReply(_message.Message):
    __slots__ = ("token", "ttl_seconds")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token: str
    ttl_seconds: float
    def __init__(self, token: _Optional[str] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class ResetDeviceRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class ResetDeviceReply(_message.Message):
    __slots__ = ("resets",)
    RESETS_FIELD_NUMBER: _ClassVar[int]
    resets: int
    def __init__(self, resets: _Optional[int] = ...) -> None: ...

class PciConfigReadRequest(_message.Message):
    __slots__ = ("address", "offset", "size")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    address: str
    offset: int
    size: int
    def __init__(self, address: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class PciConfigReadReply(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class BarReadRequest(_message.Message):
    __slots__ = ("address", "bar", "offset", "length")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BAR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    address: str
    bar: int
    offset: int
    length: int
    def __init__(self, address: _Optional[str] = ..., bar: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class BarReadReply(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class BarWriteRequest(_message.Message):
    __slots__ = ("address", "bar", "offset", "data")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BAR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    address: str
    bar: int
    offset: int
    data: bytes
    def __init__(self, address: _Optional[str] = ..., bar: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class BarWriteReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
