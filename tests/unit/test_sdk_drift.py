"""The three SDKs cannot drift from the API: every public route of the OpenAPI document
(the app's own ``app.openapi()``, what /openapi.json serves) has a call in each SDK, and no
SDK calls a route the document does not have. How each SDK's routes are read (see
sdk/contract/README.md):

- Python (pal/sdk/client.py, async_client.py, each on its own): from the syntax tree, every
  call of ``_json`` / ``_sse`` / ``request`` / ``stream`` with a literal method and a literal
  or f-string path (``_json`` and ``_sse`` add ``/v1/runtime``); any other such call is
  refused unless it forwards its own ``method`` argument.
- TypeScript (sdk/typescript/src): every ``this.json`` / ``this.request`` /
  ``this.client.json`` / ``this.client.request`` call takes a literal method and path (tsc
  already checks those against the generated types); a call with any other first argument
  is refused but the one forwarder inside ``json``.
- Go (sdk/go): the route table in routes.go, the only place a ``route{...}`` literal may be,
  every entry of which must be used by a call.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pal.api.openapi import document

REPO = Path(__file__).resolve().parents[2]
METHODS = {"GET", "POST", "PUT", "DELETE", "PATCH"}

# Routes of the document that are not SDK calls, each with its reason.
NOT_SDK_CALLS = {
    "nodes": "operator routes (node heartbeats, drain): the operator's token, not a tenant's key",
    "port_proxy_": "the reverse proxy to the guest's own server: reached by URL (PortURL's "
    "signed link, or the key), any method; not a call of the SDK",
    "GET /readyz": "the load balancer's readiness probe, for operators",
    "POST /v1/runtime/vms/{vm_id}/audit": "the MCP server's audit record of a tool call (pal/mcp "
    "writes it); not a call for an SDK's users",
}

Route = tuple[str, str]  # (METHOD, path with every {param} as {})

# Routes an SDK does not call yet, each with its reason and the SDKs it excuses (the Python
# SDK has them all). A path prefix (after /v1/runtime/vms/{}) covers every route under it.
PENDING: dict[str, tuple[str, tuple[str, ...]]] = {}


def _pending(sdk: str) -> set[Route]:
    out = set()
    for method, path in public_routes():
        for prefix, (_why, sdks) in PENDING.items():
            if sdk in sdks and path.startswith("/v1/runtime/vms/{}" + prefix):
                out.add((method, path))
    return out


def _norm(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", path)


def public_routes() -> set[Route]:
    out = set()
    for path, ops in document()["paths"].items():
        for method, op in ops.items():
            if method.upper() not in METHODS and method != "options":
                continue
            if "nodes" in op.get("tags", []) or op.get("operationId", "").startswith("port_proxy_"):
                continue
            if f"{method.upper()} {path}" in NOT_SDK_CALLS:
                continue
            out.add((method.upper(), _norm(path)))
    return out


def all_routes() -> set[Route]:
    return {(m.upper(), _norm(p)) for p, ops in document()["paths"].items() for m in ops}


def _template(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(str(v.value))
            else:
                parts.append("{}")
        return "".join(parts)
    return None


def python_routes(source: Path) -> set[Route]:
    found: set[Route] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name = node.func.attr
        if name not in ("_json", "_sse", "request", "stream") or len(node.args) < 2:
            continue
        method, path = node.args[0], _template(node.args[1])
        if isinstance(method, ast.Name) and method.id == "method":
            continue  # a forwarder: `request(method, path, ...)`
        assert isinstance(method, ast.Constant) and method.value in METHODS and path is not None, (
            f"{source.name}:{node.lineno}: an HTTP call whose route cannot be read; give it a "
            "literal method and a literal or f-string path"
        )
        found.add((method.value, _norm(("/v1/runtime" if name in ("_json", "_sse") else "") + path)))
    return found


TS_CALL = re.compile(r"\bthis(?:\.client)?\.(?:json|request)\(\s*")
TS_LITERAL = re.compile(r'"(get|post|put|delete)",\s*"(/[^"]*)"')
TS_FORWARDER = "this.request(method, path, call)"


def typescript_routes(src: Path) -> set[Route]:
    found: set[Route] = set()
    for f in sorted(src.glob("*.ts")):
        if f.name == "openapi.ts":
            continue
        text = f.read_text()
        for m in TS_CALL.finditer(text):
            lit = TS_LITERAL.match(text, m.end())
            if lit is None:
                assert text.startswith(TS_FORWARDER, m.start()), (
                    f"{f.name}: an HTTP call whose route cannot be read: {text[m.start() : m.start() + 80]!r}"
                )
                continue
            found.add((lit.group(1).upper(), _norm(lit.group(2))))
    return found


GO_ROUTE = re.compile(r'^\s*(route\w+)\s*=\s*route\{"([A-Z]+)", "(/[^"]*)"\}', re.M)


def go_routes(sdk: Path) -> set[Route]:
    table = (sdk / "routes.go").read_text()
    entries = GO_ROUTE.findall(table)
    assert len(entries) == table.count("route{") - 1, "routes.go: keep one `routeX = route{...}` per line"
    code = {f.name: f.read_text() for f in sdk.glob("*.go") if not f.name.endswith("_test.go")}
    for name, text in code.items():
        if name != "routes.go":
            assert "route{" not in text, f"{name}: routes are declared in routes.go only"
    for var, _, _ in entries:
        users = [n for n, t in code.items() if n != "routes.go" and re.search(rf"\b{var}\b", t)]
        assert users, f"routes.go: {var} is declared but no call uses it"
    return {(method, _norm(path)) for _, method, path in entries}


PY_SDK = REPO / "pal" / "sdk"
SDKS = {
    # runtime.processes (processes.py), runtime.code (code.py) and volumes (volumes.py) hold
    # both clients' calls
    "Python Client (pal/sdk/client.py)": lambda: (
        python_routes(PY_SDK / "client.py")
        | python_routes(PY_SDK / "processes.py")
        | python_routes(PY_SDK / "code.py")
        | python_routes(PY_SDK / "volumes.py")
    ),
    "Python AsyncClient (pal/sdk/async_client.py)": lambda: (
        python_routes(PY_SDK / "async_client.py")
        | python_routes(PY_SDK / "processes.py")
        | python_routes(PY_SDK / "code.py")
        | python_routes(PY_SDK / "volumes.py")
    ),
    "TypeScript (sdk/typescript/src)": lambda: typescript_routes(REPO / "sdk" / "typescript" / "src"),
    "Go (sdk/go/routes.go)": lambda: go_routes(REPO / "sdk" / "go"),
}


@pytest.mark.parametrize("sdk", sorted(SDKS))
def test_every_public_route_has_a_call_in_the_sdk(sdk: str) -> None:
    missing = public_routes() - SDKS[sdk]() - _pending(sdk)
    assert not missing, f"{sdk} has no call for {sorted(missing)} (or add it to NOT_SDK_CALLS with a reason)"


@pytest.mark.parametrize("sdk", sorted(SDKS))
def test_the_sdk_calls_only_routes_the_api_has(sdk: str) -> None:
    unknown = SDKS[sdk]() - all_routes()
    assert not unknown, f"{sdk} calls routes the OpenAPI document does not have: {sorted(unknown)}"


def test_the_readers_see_the_sdks_routes() -> None:
    """The readers are not blind: each finds the routes a known call uses, and flags a call
    whose route it cannot read."""
    assert ("PUT", "/v1/runtime/vms/{}/secrets/{}") in SDKS["Python Client (pal/sdk/client.py)"]()
    assert ("GET", "/healthz") in SDKS["TypeScript (sdk/typescript/src)"]()
    assert ("POST", "/v1/runtime/vms/{}/ports/{}/url") in SDKS["Go (sdk/go/routes.go)"]()
    assert len(public_routes()) >= 18


def test_an_unreadable_python_call_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "client.py"
    f.write_text('def f(self, p):\n    return self._json("GET", "/vms/" + p)\n')
    with pytest.raises(AssertionError, match="cannot be read"):
        python_routes(f)


def test_an_unreadable_typescript_call_is_refused(tmp_path: Path) -> None:
    (tmp_path / "client.ts").write_text('const r = this.client.json(m, "/v1/images");\n')
    with pytest.raises(AssertionError, match="cannot be read"):
        typescript_routes(tmp_path)
