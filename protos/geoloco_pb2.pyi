from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Capabilities(_message.Message):
    __slots__ = ("device", "hostname", "version", "threads")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    device: str
    hostname: str
    version: str
    threads: int
    def __init__(self, device: _Optional[str] = ..., hostname: _Optional[str] = ..., version: _Optional[str] = ..., threads: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("token", "capabilities", "reclaim_worker_id", "reclaim_session", "protocol_version")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_SESSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    token: str
    capabilities: Capabilities
    reclaim_worker_id: int
    reclaim_session: str
    protocol_version: int
    def __init__(self, token: _Optional[str] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., reclaim_worker_id: _Optional[int] = ..., reclaim_session: _Optional[str] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("worker_id", "session", "run_config_json", "current_round", "layout_digest", "wan_profile", "straggler_profile", "protocol_version")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    CURRENT_ROUND_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    WAN_PROFILE_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_PROFILE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    session: str
    run_config_json: str
    current_round: int
    layout_digest: bytes
    wan_profile: str
    straggler_profile: str
    protocol_version: int
    def __init__(self, worker_id: _Optional[int] = ..., session: _Optional[str] = ..., run_config_json: _Optional[str] = ..., current_round: _Optional[int] = ..., layout_digest: _Optional[bytes] = ..., wan_profile: _Optional[str] = ..., straggler_profile: _Optional[str] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class FetchStateRequest(_message.Message):
    __slots__ = ("worker_id", "session")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    session: str
    def __init__(self, worker_id: _Optional[int] = ..., session: _Optional[str] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("round", "digest", "total_bytes", "data", "task", "next_task")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    NEXT_TASK_FIELD_NUMBER: _ClassVar[int]
    round: int
    digest: str
    total_bytes: int
    data: bytes
    task: WorkerTask
    next_task: WorkerTask
    def __init__(self, round: _Optional[int] = ..., digest: _Optional[str] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., task: _Optional[_Union[WorkerTask, _Mapping]] = ..., next_task: _Optional[_Union[WorkerTask, _Mapping]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("worker_id", "session", "round", "total_bytes", "compute_seconds", "train_loss", "partitions", "encode_seconds", "apply_seconds", "digest_mismatches", "resyncs", "density", "upload_rate")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    DENSITY_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_RATE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    session: str
    round: int
    total_bytes: int
    compute_seconds: float
    train_loss: float
    partitions: _containers.RepeatedScalarFieldContainer[int]
    encode_seconds: float
    apply_seconds: float
    digest_mismatches: int
    resyncs: int
    density: float
    upload_rate: float
    def __init__(self, worker_id: _Optional[int] = ..., session: _Optional[str] = ..., round: _Optional[int] = ..., total_bytes: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., train_loss: _Optional[float] = ..., partitions: _Optional[_Iterable[int]] = ..., encode_seconds: _Optional[float] = ..., apply_seconds: _Optional[float] = ..., digest_mismatches: _Optional[int] = ..., resyncs: _Optional[int] = ..., density: _Optional[float] = ..., upload_rate: _Optional[float] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("accepted", "reason", "round")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    round: int
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class RoundsRequest(_message.Message):
    __slots__ = ("worker_id", "session", "from_round", "starting")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    FROM_ROUND_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    session: str
    from_round: int
    starting: bool
    def __init__(self, worker_id: _Optional[int] = ..., session: _Optional[str] = ..., from_round: _Optional[int] = ..., starting: _Optional[bool] = ...) -> None: ...

class WorkerTask(_message.Message):
    __slots__ = ("round", "train_partitions", "send_partitions", "send_coefficients")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TRAIN_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    SEND_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    SEND_COEFFICIENTS_FIELD_NUMBER: _ClassVar[int]
    round: int
    train_partitions: _containers.RepeatedScalarFieldContainer[int]
    send_partitions: _containers.RepeatedScalarFieldContainer[int]
    send_coefficients: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, round: _Optional[int] = ..., train_partitions: _Optional[_Iterable[int]] = ..., send_partitions: _Optional[_Iterable[int]] = ..., send_coefficients: _Optional[_Iterable[float]] = ...) -> None: ...

class FrameInfo(_message.Message):
    __slots__ = ("sender", "weight", "nbytes")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    sender: int
    weight: float
    nbytes: int
    def __init__(self, sender: _Optional[int] = ..., weight: _Optional[float] = ..., nbytes: _Optional[int] = ...) -> None: ...

class RoundHeader(_message.Message):
    __slots__ = ("round", "frames", "aggregation", "alpha", "next_task", "finished", "arrived", "settlement", "task_after_next")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    NEXT_TASK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    SETTLEMENT_FIELD_NUMBER: _ClassVar[int]
    TASK_AFTER_NEXT_FIELD_NUMBER: _ClassVar[int]
    round: int
    frames: _containers.RepeatedCompositeFieldContainer[FrameInfo]
    aggregation: str
    alpha: float
    next_task: WorkerTask
    finished: bool
    arrived: _containers.RepeatedScalarFieldContainer[int]
    settlement: Settlement
    task_after_next: WorkerTask
    def __init__(self, round: _Optional[int] = ..., frames: _Optional[_Iterable[_Union[FrameInfo, _Mapping]]] = ..., aggregation: _Optional[str] = ..., alpha: _Optional[float] = ..., next_task: _Optional[_Union[WorkerTask, _Mapping]] = ..., finished: _Optional[bool] = ..., arrived: _Optional[_Iterable[int]] = ..., settlement: _Optional[_Union[Settlement, _Mapping]] = ..., task_after_next: _Optional[_Union[WorkerTask, _Mapping]] = ...) -> None: ...

class Settlement(_message.Message):
    __slots__ = ("kind", "sender", "mate_frame")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KEEP: _ClassVar[Settlement.Kind]
        RESTORE: _ClassVar[Settlement.Kind]
        ADD_BACK: _ClassVar[Settlement.Kind]
        CREDIT: _ClassVar[Settlement.Kind]
    KEEP: Settlement.Kind
    RESTORE: Settlement.Kind
    ADD_BACK: Settlement.Kind
    CREDIT: Settlement.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    MATE_FRAME_FIELD_NUMBER: _ClassVar[int]
    kind: Settlement.Kind
    sender: int
    mate_frame: bytes
    def __init__(self, kind: _Optional[_Union[Settlement.Kind, str]] = ..., sender: _Optional[int] = ..., mate_frame: _Optional[bytes] = ...) -> None: ...

class RoundDigest(_message.Message):
    __slots__ = ("round", "digest")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    round: int
    digest: str
    def __init__(self, round: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class RoundUpdate(_message.Message):
    __slots__ = ("header", "data", "keepalive", "digest")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    header: RoundHeader
    data: bytes
    keepalive: Keepalive
    digest: RoundDigest
    def __init__(self, header: _Optional[_Union[RoundHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., keepalive: _Optional[_Union[Keepalive, _Mapping]] = ..., digest: _Optional[_Union[RoundDigest, _Mapping]] = ...) -> None: ...

class Keepalive(_message.Message):
    __slots__ = ("round",)
    ROUND_FIELD_NUMBER: _ClassVar[int]
    round: int
    def __init__(self, round: _Optional[int] = ...) -> None: ...
