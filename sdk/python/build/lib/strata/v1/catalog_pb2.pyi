from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("catalog_id", "toml")
    CATALOG_ID_FIELD_NUMBER: _ClassVar[int]
    TOML_FIELD_NUMBER: _ClassVar[int]
    catalog_id: str
    toml: str
    def __init__(self, catalog_id: _Optional[str] = ..., toml: _Optional[str] = ...) -> None: ...

class CatalogRef(_message.Message):
    __slots__ = ("catalog_id",)
    CATALOG_ID_FIELD_NUMBER: _ClassVar[int]
    catalog_id: str
    def __init__(self, catalog_id: _Optional[str] = ...) -> None: ...

class CatalogEntry(_message.Message):
    __slots__ = ("reference", "json", "layers", "backend", "registered_ms", "registered_by")
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_MS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BY_FIELD_NUMBER: _ClassVar[int]
    reference: str
    json: str
    layers: _containers.RepeatedScalarFieldContainer[str]
    backend: str
    registered_ms: int
    registered_by: str
    def __init__(self, reference: _Optional[str] = ..., json: _Optional[str] = ..., layers: _Optional[_Iterable[str]] = ..., backend: _Optional[str] = ..., registered_ms: _Optional[int] = ..., registered_by: _Optional[str] = ...) -> None: ...

class CatalogListRequest(_message.Message):
    __slots__ = ("prefix",)
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    def __init__(self, prefix: _Optional[str] = ...) -> None: ...

class CatalogListReply(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ids: _Optional[_Iterable[str]] = ...) -> None: ...

class HistoryReply(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, records: _Optional[_Iterable[str]] = ...) -> None: ...

class RemoveReply(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, removed: _Optional[_Iterable[str]] = ...) -> None: ...
