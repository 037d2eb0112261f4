from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

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
