from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Done(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SandboxRef(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class Budgets(_message.Message):
    __slots__ = ("memory", "cpus", "disk", "pids", "timeout")
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    memory: str
    cpus: float
    disk: str
    pids: int
    timeout: str
    def __init__(self, memory: _Optional[str] = ..., cpus: _Optional[float] = ..., disk: _Optional[str] = ..., pids: _Optional[int] = ..., timeout: _Optional[str] = ...) -> None: ...

class CreateRequest(_message.Message):
    __slots__ = ("catalog_id", "backend", "budgets", "env", "network", "network_set", "idle_ttl", "lifetime", "labels", "auto_hibernate")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CATALOG_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BUDGETS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    NETWORK_SET_FIELD_NUMBER: _ClassVar[int]
    IDLE_TTL_FIELD_NUMBER: _ClassVar[int]
    LIFETIME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    AUTO_HIBERNATE_FIELD_NUMBER: _ClassVar[int]
    catalog_id: str
    backend: str
    budgets: Budgets
    env: _containers.ScalarMap[str, str]
    network: _containers.RepeatedScalarFieldContainer[str]
    network_set: bool
    idle_ttl: str
    lifetime: str
    labels: _containers.ScalarMap[str, str]
    auto_hibernate: str
    def __init__(self, catalog_id: _Optional[str] = ..., backend: _Optional[str] = ..., budgets: _Optional[_Union[Budgets, _Mapping]] = ..., env: _Optional[_Mapping[str, str]] = ..., network: _Optional[_Iterable[str]] = ..., network_set: _Optional[bool] = ..., idle_ttl: _Optional[str] = ..., lifetime: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., auto_hibernate: _Optional[str] = ...) -> None: ...

class SandboxInfo(_message.Message):
    __slots__ = ("id", "catalog_ref", "backend", "state", "labels", "project", "created_ms", "memory_bytes", "cpus", "disk_bytes", "idle_ttl_ms", "expires_ms", "idle_ms", "node")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    CATALOG_REF_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    CREATED_MS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDLE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    id: str
    catalog_ref: str
    backend: str
    state: str
    labels: _containers.ScalarMap[str, str]
    project: str
    created_ms: int
    memory_bytes: int
    cpus: float
    disk_bytes: int
    idle_ttl_ms: int
    expires_ms: int
    idle_ms: int
    node: str
    def __init__(self, id: _Optional[str] = ..., catalog_ref: _Optional[str] = ..., backend: _Optional[str] = ..., state: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., project: _Optional[str] = ..., created_ms: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., cpus: _Optional[float] = ..., disk_bytes: _Optional[int] = ..., idle_ttl_ms: _Optional[int] = ..., expires_ms: _Optional[int] = ..., idle_ms: _Optional[int] = ..., node: _Optional[str] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("labels",)
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LABELS_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListReply(_message.Message):
    __slots__ = ("sandboxes",)
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[SandboxInfo]
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[SandboxInfo, _Mapping]]] = ...) -> None: ...

class ExecRequest(_message.Message):
    __slots__ = ("id", "argv", "env", "cwd", "timeout", "stdin", "keep_output", "step_id")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    KEEP_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    cwd: str
    timeout: str
    stdin: bytes
    keep_output: int
    step_id: str
    def __init__(self, id: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ..., timeout: _Optional[str] = ..., stdin: _Optional[bytes] = ..., keep_output: _Optional[int] = ..., step_id: _Optional[str] = ...) -> None: ...

class ExecReply(_message.Message):
    __slots__ = ("exit_code", "signal", "stdout", "stderr", "truncated", "stdout_bytes", "stderr_bytes", "duration_ms", "budget", "budgets_hit", "has_signal", "replayed")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDOUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STDERR_BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    BUDGETS_HIT_FIELD_NUMBER: _ClassVar[int]
    HAS_SIGNAL_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    signal: int
    stdout: bytes
    stderr: bytes
    truncated: bool
    stdout_bytes: int
    stderr_bytes: int
    duration_ms: int
    budget: str
    budgets_hit: _containers.RepeatedScalarFieldContainer[str]
    has_signal: bool
    replayed: bool
    def __init__(self, exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., truncated: _Optional[bool] = ..., stdout_bytes: _Optional[int] = ..., stderr_bytes: _Optional[int] = ..., duration_ms: _Optional[int] = ..., budget: _Optional[str] = ..., budgets_hit: _Optional[_Iterable[str]] = ..., has_signal: _Optional[bool] = ..., replayed: _Optional[bool] = ...) -> None: ...

class ExecInput(_message.Message):
    __slots__ = ("request", "stdin", "close_stdin")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    CLOSE_STDIN_FIELD_NUMBER: _ClassVar[int]
    request: ExecRequest
    stdin: bytes
    close_stdin: bool
    def __init__(self, request: _Optional[_Union[ExecRequest, _Mapping]] = ..., stdin: _Optional[bytes] = ..., close_stdin: _Optional[bool] = ...) -> None: ...

class ExecEvent(_message.Message):
    __slots__ = ("stdout", "stderr", "exit")
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    stdout: bytes
    stderr: bytes
    exit: ExecReply
    def __init__(self, stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., exit: _Optional[_Union[ExecReply, _Mapping]] = ...) -> None: ...

class FileRef(_message.Message):
    __slots__ = ("id", "path")
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    id: str
    path: str
    def __init__(self, id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class WriteChunk(_message.Message):
    __slots__ = ("id", "path", "mode", "data")
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    id: str
    path: str
    mode: int
    data: bytes
    def __init__(self, id: _Optional[str] = ..., path: _Optional[str] = ..., mode: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WriteReply(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...

class FileEntry(_message.Message):
    __slots__ = ("name", "size", "is_dir", "mode", "kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    IS_DIR_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    is_dir: bool
    mode: int
    kind: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., is_dir: _Optional[bool] = ..., mode: _Optional[int] = ..., kind: _Optional[str] = ...) -> None: ...

class ListDirReply(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[FileEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[FileEntry, _Mapping]]] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("id", "path", "recursive")
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    id: str
    path: str
    recursive: bool
    def __init__(self, id: _Optional[str] = ..., path: _Optional[str] = ..., recursive: _Optional[bool] = ...) -> None: ...

class MakeDirRequest(_message.Message):
    __slots__ = ("id", "path", "parents")
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    path: str
    parents: bool
    def __init__(self, id: _Optional[str] = ..., path: _Optional[str] = ..., parents: _Optional[bool] = ...) -> None: ...

class ProcessInfo(_message.Message):
    __slots__ = ("pid", "state", "rss_bytes", "cmdline")
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    CMDLINE_FIELD_NUMBER: _ClassVar[int]
    pid: int
    state: str
    rss_bytes: int
    cmdline: str
    def __init__(self, pid: _Optional[int] = ..., state: _Optional[str] = ..., rss_bytes: _Optional[int] = ..., cmdline: _Optional[str] = ...) -> None: ...

class ProcessList(_message.Message):
    __slots__ = ("processes",)
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    processes: _containers.RepeatedCompositeFieldContainer[ProcessInfo]
    def __init__(self, processes: _Optional[_Iterable[_Union[ProcessInfo, _Mapping]]] = ...) -> None: ...

class HibernateRequest(_message.Message):
    __slots__ = ("ids", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    IDS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, ids: _Optional[_Iterable[str]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Hibernated(_message.Message):
    __slots__ = ("id", "state_bytes", "ms", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: str
    state_bytes: int
    ms: int
    error: str
    def __init__(self, id: _Optional[str] = ..., state_bytes: _Optional[int] = ..., ms: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class HibernateReply(_message.Message):
    __slots__ = ("sandboxes", "ms")
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[Hibernated]
    ms: int
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[Hibernated, _Mapping]]] = ..., ms: _Optional[int] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("id", "count")
    ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    id: str
    count: int
    def __init__(self, id: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class ForkReply(_message.Message):
    __slots__ = ("children", "processes", "ms")
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    children: _containers.RepeatedCompositeFieldContainer[SandboxInfo]
    processes: bool
    ms: int
    def __init__(self, children: _Optional[_Iterable[_Union[SandboxInfo, _Mapping]]] = ..., processes: _Optional[bool] = ..., ms: _Optional[int] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("id", "dir", "to_store", "names", "files_only")
    ID_FIELD_NUMBER: _ClassVar[int]
    DIR_FIELD_NUMBER: _ClassVar[int]
    TO_STORE_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    FILES_ONLY_FIELD_NUMBER: _ClassVar[int]
    id: str
    dir: str
    to_store: bool
    names: _containers.RepeatedScalarFieldContainer[str]
    files_only: bool
    def __init__(self, id: _Optional[str] = ..., dir: _Optional[str] = ..., to_store: _Optional[bool] = ..., names: _Optional[_Iterable[str]] = ..., files_only: _Optional[bool] = ...) -> None: ...

class SnapshotReply(_message.Message):
    __slots__ = ("state_bytes", "disk_bytes", "millis", "snapshot")
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MILLIS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    state_bytes: int
    disk_bytes: int
    millis: float
    snapshot: SnapshotInfo
    def __init__(self, state_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., millis: _Optional[float] = ..., snapshot: _Optional[_Union[SnapshotInfo, _Mapping]] = ...) -> None: ...

class SnapshotId(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class SnapshotInfo(_message.Message):
    __slots__ = ("id", "layer", "memory", "backend", "sandbox", "catalog_ref", "project", "names", "taken_ms", "state_bytes", "disk_bytes", "stored_bytes", "uploaded_bytes", "seconds", "taken_by")
    ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    CATALOG_REF_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    TAKEN_MS_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    TAKEN_BY_FIELD_NUMBER: _ClassVar[int]
    id: str
    layer: str
    memory: bool
    backend: str
    sandbox: str
    catalog_ref: str
    project: str
    names: _containers.RepeatedScalarFieldContainer[str]
    taken_ms: int
    state_bytes: int
    disk_bytes: int
    stored_bytes: int
    uploaded_bytes: int
    seconds: float
    taken_by: str
    def __init__(self, id: _Optional[str] = ..., layer: _Optional[str] = ..., memory: _Optional[bool] = ..., backend: _Optional[str] = ..., sandbox: _Optional[str] = ..., catalog_ref: _Optional[str] = ..., project: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., taken_ms: _Optional[int] = ..., state_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., uploaded_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., taken_by: _Optional[str] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("snapshot", "labels", "lifetime")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    LIFETIME_FIELD_NUMBER: _ClassVar[int]
    snapshot: str
    labels: _containers.ScalarMap[str, str]
    lifetime: str
    def __init__(self, snapshot: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., lifetime: _Optional[str] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSnapshotsReply(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotInfo]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[SnapshotInfo, _Mapping]]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("id", "kind", "register")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: str
    register: str
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[str] = ..., register: _Optional[str] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("layer", "registered", "files", "logical_bytes", "uploaded_bytes", "created", "seconds")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    layer: str
    registered: str
    files: int
    logical_bytes: int
    uploaded_bytes: int
    created: bool
    seconds: float
    def __init__(self, layer: _Optional[str] = ..., registered: _Optional[str] = ..., files: _Optional[int] = ..., logical_bytes: _Optional[int] = ..., uploaded_bytes: _Optional[int] = ..., created: _Optional[bool] = ..., seconds: _Optional[float] = ...) -> None: ...

class EvaluateRequest(_message.Message):
    __slots__ = ("id", "command", "backend")
    ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    id: str
    command: str
    backend: str
    def __init__(self, id: _Optional[str] = ..., command: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class ChangedPath(_message.Message):
    __slots__ = ("path", "change", "protected")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    PROTECTED_FIELD_NUMBER: _ClassVar[int]
    path: str
    change: str
    protected: bool
    def __init__(self, path: _Optional[str] = ..., change: _Optional[str] = ..., protected: _Optional[bool] = ...) -> None: ...

class EvaluateReply(_message.Message):
    __slots__ = ("command", "line", "exit_code", "budget", "stdout", "stderr", "truncated", "layer", "backend", "sandbox", "evaluator_layer", "protected", "changed", "changed_total", "seconds")
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    EVALUATOR_LAYER_FIELD_NUMBER: _ClassVar[int]
    PROTECTED_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    CHANGED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    command: str
    line: str
    exit_code: int
    budget: str
    stdout: bytes
    stderr: bytes
    truncated: bool
    layer: str
    backend: str
    sandbox: str
    evaluator_layer: str
    protected: _containers.RepeatedScalarFieldContainer[str]
    changed: _containers.RepeatedCompositeFieldContainer[ChangedPath]
    changed_total: int
    seconds: float
    def __init__(self, command: _Optional[str] = ..., line: _Optional[str] = ..., exit_code: _Optional[int] = ..., budget: _Optional[str] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., truncated: _Optional[bool] = ..., layer: _Optional[str] = ..., backend: _Optional[str] = ..., sandbox: _Optional[str] = ..., evaluator_layer: _Optional[str] = ..., protected: _Optional[_Iterable[str]] = ..., changed: _Optional[_Iterable[_Union[ChangedPath, _Mapping]]] = ..., changed_total: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ExtendRequest(_message.Message):
    __slots__ = ("id", "idle_ttl", "lifetime")
    ID_FIELD_NUMBER: _ClassVar[int]
    IDLE_TTL_FIELD_NUMBER: _ClassVar[int]
    LIFETIME_FIELD_NUMBER: _ClassVar[int]
    id: str
    idle_ttl: str
    lifetime: str
    def __init__(self, id: _Optional[str] = ..., idle_ttl: _Optional[str] = ..., lifetime: _Optional[str] = ...) -> None: ...

class SetNetworkRequest(_message.Message):
    __slots__ = ("id", "network")
    ID_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    id: str
    network: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., network: _Optional[_Iterable[str]] = ...) -> None: ...

class AuditReply(_message.Message):
    __slots__ = ("jsonl",)
    JSONL_FIELD_NUMBER: _ClassVar[int]
    jsonl: str
    def __init__(self, jsonl: _Optional[str] = ...) -> None: ...

class JournalStep(_message.Message):
    __slots__ = ("step_id", "argv", "cwd", "state", "started_ms", "finished_ms", "result", "error")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STARTED_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_MS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    cwd: str
    state: str
    started_ms: int
    finished_ms: int
    result: ExecReply
    error: str
    def __init__(self, step_id: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., cwd: _Optional[str] = ..., state: _Optional[str] = ..., started_ms: _Optional[int] = ..., finished_ms: _Optional[int] = ..., result: _Optional[_Union[ExecReply, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class JournalReply(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[JournalStep]
    def __init__(self, steps: _Optional[_Iterable[_Union[JournalStep, _Mapping]]] = ...) -> None: ...
