"""The Connect codecs of the agent API: protobuf binary and JSON (the pinned SDKs send
JSON), with a request that does not decode answered as ``invalid_argument``: the runtime
would otherwise end the call as ``unknown`` and raise out of the ASGI app."""

from __future__ import annotations

from typing import Any

from connectrpc.code import Code
from connectrpc.codec import Codec, proto_binary_codec, proto_json_codec
from connectrpc.errors import ConnectError


class RequestChecked:
    """A codec whose decode failures are the client's error, never the server's."""

    def __init__(self, inner: Codec[Any, Any]) -> None:
        self.inner = inner

    def name(self) -> str:
        return self.inner.name()

    def encode(self, message: Any) -> bytes:
        return self.inner.encode(message)

    def decode(self, data: Any, message_class: Any) -> Any:
        try:
            return self.inner.decode(data, message_class)
        except ConnectError:
            raise
        except Exception as exc:
            raise ConnectError(
                Code.INVALID_ARGUMENT, f"the request is not a {message_class.__name__}: {exc}"
            ) from None


def agent_codecs() -> list[Codec[Any, Any]]:
    return [RequestChecked(proto_binary_codec()), RequestChecked(proto_json_codec())]
