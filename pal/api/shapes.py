"""The base of the API's own JSON shapes that were the node's first (processes, code
contexts, port and attach links): camelCase, unknown fields refused, and read from the
node's answer of the same fields by :meth:`Shape.of`."""

from __future__ import annotations

from typing import Self, TypeVar

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

Source = TypeVar("Source", bound=BaseModel)


class Shape(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", from_attributes=True
    )

    @classmethod
    def of(cls, source: Source) -> Self:
        """This shape of ``source`` (a node's answer), field by field."""
        return cls.model_validate(source, from_attributes=True)
