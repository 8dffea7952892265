"""Protobuf messages as the JSON that Triton's tools read: proto field names, and 64-bit integers as JSON
numbers. (Protobuf's JSON mapping writes 64-bit integers as strings; Triton's REST API and the `config`
that its Python backend hands to `initialize` carry them as numbers.)"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def message_json(
    message: Message, *, every_field: bool = False, every_message: bool = False
) -> dict[str, Any]:
    """`message` as a JSON object; with `every_field`, fields left at their defaults are written too (zeros,
    empty strings, lists and maps: what Triton writes for a model's configuration); with `every_message`, also
    every message field outside a oneof that is not set, as an object of its defaults (what Triton writes for
    statistics: `{"count": 0, "ns": 0}` for a duration nothing was counted in)."""
    if every_message:
        filled = type(message)()
        filled.CopyFrom(message)
        _set_messages(filled)
        message = filled
    data = json_format.MessageToDict(
        message,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=every_field or every_message,
    )
    return _int64_as_numbers(message, data)


def _set_messages(message: Message) -> None:
    """Set, in place, every message field of `message` outside a oneof, at every depth."""
    for field in message.DESCRIPTOR.fields:
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        value = getattr(message, field.name)
        if field.message_type.GetOptions().map_entry:
            if field.message_type.fields_by_name["value"].type == FieldDescriptor.TYPE_MESSAGE:
                for item in value.values():
                    _set_messages(item)
        elif field.is_repeated:
            for item in value:
                _set_messages(item)
        elif field.containing_oneof is None:
            value.SetInParent()
            _set_messages(value)


def _json_key(key: object) -> str:
    """A map key as protobuf's JSON mapping writes it."""
    return ("true" if key else "false") if isinstance(key, bool) else str(key)


def _int64_as_numbers(message: Message, data: dict[str, Any]) -> dict[str, Any]:
    """Rewrite, in place, every 64-bit integer of `data` (the JSON of `message`) as a number: in fields,
    repeated fields, nested messages, and map values (maps keyed by 64-bit integers included)."""
    for field in message.DESCRIPTOR.fields:
        name = field.name
        if name not in data:
            continue
        value = getattr(message, name)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                value_field = field.message_type.fields_by_name["value"]
                entries = data[name]
                for key, item in value.items():
                    if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                        _int64_as_numbers(item, entries[_json_key(key)])
                    elif value_field.type in _INT64_TYPES:
                        entries[_json_key(key)] = int(item)
            elif field.is_repeated:
                for item, entry in zip(value, data[name], strict=True):
                    _int64_as_numbers(item, entry)
            else:
                _int64_as_numbers(value, data[name])
        elif field.type in _INT64_TYPES:
            data[name] = [int(v) for v in value] if field.is_repeated else int(value)
    return data
