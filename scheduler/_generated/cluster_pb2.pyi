from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeDevice(_message.Message):
    __slots__ = ("name", "kind", "memory_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    memory_bytes: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "host_key", "address", "devices", "transports", "rank", "rendezvous", "pid")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_KEY_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    host_key: str
    address: str
    devices: _containers.RepeatedCompositeFieldContainer[NodeDevice]
    transports: _containers.RepeatedScalarFieldContainer[str]
    rank: int
    rendezvous: str
    pid: int
    def __init__(self, node_id: _Optional[str] = ..., host_key: _Optional[str] = ..., address: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[NodeDevice, _Mapping]]] = ..., transports: _Optional[_Iterable[str]] = ..., rank: _Optional[int] = ..., rendezvous: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("node", "world_size", "incarnation")
    NODE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    world_size: int
    incarnation: int
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ..., world_size: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("rank", "epoch", "heartbeat_interval_s", "miss_limit")
    RANK_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    MISS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    epoch: int
    heartbeat_interval_s: float
    miss_limit: int
    def __init__(self, rank: _Optional[int] = ..., epoch: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., miss_limit: _Optional[int] = ...) -> None: ...

class LinkReport(_message.Message):
    __slots__ = ("src", "dst", "kind", "latency_s", "bandwidth_bps")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    src: str
    dst: str
    kind: str
    latency_s: float
    bandwidth_bps: float
    def __init__(self, src: _Optional[str] = ..., dst: _Optional[str] = ..., kind: _Optional[str] = ..., latency_s: _Optional[float] = ..., bandwidth_bps: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "epoch", "links")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    links: _containers.RepeatedCompositeFieldContainer[LinkReport]
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., links: _Optional[_Iterable[_Union[LinkReport, _Mapping]]] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("node", "state", "last_seen_age_s", "reason")
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_AGE_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    state: str
    last_seen_age_s: float
    reason: str
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ..., state: _Optional[str] = ..., last_seen_age_s: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("epoch", "dead")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DEAD_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    dead: _containers.RepeatedCompositeFieldContainer[Member]
    def __init__(self, epoch: _Optional[int] = ..., dead: _Optional[_Iterable[_Union[Member, _Mapping]]] = ...) -> None: ...

class WaitRequest(_message.Message):
    __slots__ = ("node_id", "world_size", "timeout_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    world_size: int
    timeout_s: float
    def __init__(self, node_id: _Optional[str] = ..., world_size: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class PeerGroup(_message.Message):
    __slots__ = ("group_id", "kind", "nodes", "devices")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    kind: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    devices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group_id: _Optional[str] = ..., kind: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., devices: _Optional[_Iterable[str]] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("epoch", "members", "groups", "links", "heartbeat_interval_s", "miss_limit")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    MISS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    groups: _containers.RepeatedCompositeFieldContainer[PeerGroup]
    links: _containers.RepeatedCompositeFieldContainer[LinkReport]
    heartbeat_interval_s: float
    miss_limit: int
    def __init__(self, epoch: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[PeerGroup, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[LinkReport, _Mapping]]] = ..., heartbeat_interval_s: _Optional[float] = ..., miss_limit: _Optional[int] = ...) -> None: ...

class RendezvousRequest(_message.Message):
    __slots__ = ("node_id", "incarnation", "min_size", "max_size", "last_call_s", "timeout_s", "rendezvous")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MIN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_CALL_S_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    min_size: int
    max_size: int
    last_call_s: float
    timeout_s: float
    rendezvous: str
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., min_size: _Optional[int] = ..., max_size: _Optional[int] = ..., last_call_s: _Optional[float] = ..., timeout_s: _Optional[float] = ..., rendezvous: _Optional[str] = ...) -> None: ...

class RoundReply(_message.Message):
    __slots__ = ("round", "rank", "world_size", "members", "epoch")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    round: int
    rank: int
    world_size: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    epoch: int
    def __init__(self, round: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., epoch: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...
