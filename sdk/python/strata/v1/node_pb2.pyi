from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("status", "node")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    status: str
    node: str
    def __init__(self, status: _Optional[str] = ..., node: _Optional[str] = ...) -> None: ...

class VersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VersionReply(_message.Message):
    __slots__ = ("version", "api")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    API_FIELD_NUMBER: _ClassVar[int]
    version: str
    api: str
    def __init__(self, version: _Optional[str] = ..., api: _Optional[str] = ...) -> None: ...

class CapacityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BackendCount(_message.Message):
    __slots__ = ("backend", "state", "count")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    backend: str
    state: str
    count: int
    def __init__(self, backend: _Optional[str] = ..., state: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class CapacityReply(_message.Message):
    __slots__ = ("node", "cores", "memory_bytes", "admit_memory_bytes", "admit_cpus", "committed_memory_bytes", "committed_cpus", "sandboxes", "project_sandboxes", "project_max_sandboxes")
    NODE_FIELD_NUMBER: _ClassVar[int]
    CORES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADMIT_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADMIT_CPUS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_CPUS_FIELD_NUMBER: _ClassVar[int]
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    PROJECT_SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    PROJECT_MAX_SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    node: str
    cores: int
    memory_bytes: int
    admit_memory_bytes: int
    admit_cpus: float
    committed_memory_bytes: int
    committed_cpus: float
    sandboxes: _containers.RepeatedCompositeFieldContainer[BackendCount]
    project_sandboxes: int
    project_max_sandboxes: int
    def __init__(self, node: _Optional[str] = ..., cores: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., admit_memory_bytes: _Optional[int] = ..., admit_cpus: _Optional[float] = ..., committed_memory_bytes: _Optional[int] = ..., committed_cpus: _Optional[float] = ..., sandboxes: _Optional[_Iterable[_Union[BackendCount, _Mapping]]] = ..., project_sandboxes: _Optional[int] = ..., project_max_sandboxes: _Optional[int] = ...) -> None: ...
