"""A request's nested parameter object (`structured_outputs`, `repetition_detection`) as the
dataclass that holds it, with a message a client can act on where Python's would name keyword
arguments."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def dataclass_from_request(cls: type[T], fields: Any, name: str) -> T:
    """`cls(**fields)`; a ValueError when `fields` is no object or has a key that is no field
    of `cls` (naming the key and the fields there are)."""
    known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    if not isinstance(fields, dict):
        raise ValueError(
            f"{name} must be an object with fields {', '.join(known)}, got {fields!r:.100}"
        )
    unknown = [k for k in fields if k not in known]
    if unknown:
        raise ValueError(
            f"{name} has no field {', '.join(map(repr, unknown))} (its fields: {', '.join(known)})"
        )
    return cls(**fields)
