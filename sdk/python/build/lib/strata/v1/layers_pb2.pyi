from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LayerRef(_message.Message):
    __slots__ = ("layer",)
    LAYER_FIELD_NUMBER: _ClassVar[int]
    layer: str
    def __init__(self, layer: _Optional[str] = ...) -> None: ...

class LayerInfo(_message.Message):
    __slots__ = ("id", "manifest_json", "provenance_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    PROVENANCE_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    manifest_json: str
    provenance_json: str
    def __init__(self, id: _Optional[str] = ..., manifest_json: _Optional[str] = ..., provenance_json: _Optional[str] = ...) -> None: ...

class LayerListRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LayerListReply(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ids: _Optional[_Iterable[str]] = ...) -> None: ...

class BuildSpec(_message.Message):
    __slots__ = ("kind", "name", "version", "exclude", "prefix", "image")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    version: str
    exclude: _containers.RepeatedScalarFieldContainer[str]
    prefix: str
    image: str
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., version: _Optional[str] = ..., exclude: _Optional[_Iterable[str]] = ..., prefix: _Optional[str] = ..., image: _Optional[str] = ...) -> None: ...

class BuildInput(_message.Message):
    __slots__ = ("spec", "tar")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TAR_FIELD_NUMBER: _ClassVar[int]
    spec: BuildSpec
    tar: bytes
    def __init__(self, spec: _Optional[_Union[BuildSpec, _Mapping]] = ..., tar: _Optional[bytes] = ...) -> None: ...

class BuildResult(_message.Message):
    __slots__ = ("id", "files", "logical_bytes", "uploaded_bytes", "new_data_bytes", "chunks", "reused_chunks", "seconds", "report_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEW_DATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    REUSED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPORT_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    files: int
    logical_bytes: int
    uploaded_bytes: int
    new_data_bytes: int
    chunks: int
    reused_chunks: int
    seconds: float
    report_json: str
    def __init__(self, id: _Optional[str] = ..., files: _Optional[int] = ..., logical_bytes: _Optional[int] = ..., uploaded_bytes: _Optional[int] = ..., new_data_bytes: _Optional[int] = ..., chunks: _Optional[int] = ..., reused_chunks: _Optional[int] = ..., seconds: _Optional[float] = ..., report_json: _Optional[str] = ...) -> None: ...

class BuildEvent(_message.Message):
    __slots__ = ("received_bytes", "built_bytes", "done")
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUILT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    built_bytes: int
    done: BuildResult
    def __init__(self, received_bytes: _Optional[int] = ..., built_bytes: _Optional[int] = ..., done: _Optional[_Union[BuildResult, _Mapping]] = ...) -> None: ...
