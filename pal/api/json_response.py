"""The API's JSON answers end with a newline, so that `curl` in a terminal leaves the
prompt on a line of its own (JSON parsers ignore it). Every route and error handler of
pal/api answers through this class (``create_app``'s default response class)."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse as _StarletteJSON


class JSONResponse(_StarletteJSON):
    def render(self, content: Any) -> bytes:
        return super().render(content) + b"\n"
