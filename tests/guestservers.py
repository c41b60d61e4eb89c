"""Servers the ports tests start inside a guest (stdlib only: the guest has Python, nothing
else). Run as ``python3 -c APP`` in the guest; it writes /tmp/servers-up once listening.

- 0.0.0.0:8000 (http.server): ``/headers`` answers the request's headers as JSON,
  ``/echo`` answers the body it was sent (``?mark=NAME``: creates /workspace/NAME as soon
  as the first chunk is in), ``/sse`` sends event N and then waits until the
  file /workspace/go-N exists before sending event N+1 (so a test can prove each event
  arrives before the next one exists), ``/cookie`` sets a cookie.
- 127.0.0.1:8001: a WebSocket echo server (loopback only: reached through the relay).
"""

APP = r"""
import base64, hashlib, http.server, json, os, socket, socketserver, struct, threading, time

class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def _send(self, body, ctype="application/json", extra=()):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path.startswith("/headers"):
            self._send(json.dumps({"path": self.path, "headers": dict(self.headers.items())}).encode())
        elif self.path == "/cookie":
            self._send(b"{}", extra=[("Set-Cookie", "app=1; Path=/; Domain=evil.test")])
        elif self.path == "/sse":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for n in range(1, 4):
                self.wfile.write(f"data: event-{n}\n\n".encode())
                self.wfile.flush()
                while n < 3 and not os.path.exists(f"/workspace/go-{n}"):
                    time.sleep(0.05)
            self.close_connection = True
        else:
            self._send(b"hello from the guest\n", "text/plain")
    def do_POST(self):
        # /echo?mark=NAME: once the first chunk of the body is in, /workspace/NAME exists
        # (the test then knows the proxy streamed it, before it sends the rest).
        mark = self.path.split("mark=", 1)[1] if "mark=" in self.path else None
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    break
                body += self.rfile.read(size)
                self.rfile.readline()
                if mark:
                    open("/workspace/" + mark, "w").close()
                    mark = None
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._send(body, "application/octet-stream")

def ws_client(c):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = c.recv(4096)
        if not chunk:
            return
        data += chunk
    head = data.split(b"\r\n\r\n")[0].decode()
    lines = head.split("\r\n")
    hdrs = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:] if ":" in l)}
    if "sec-websocket-key" not in hdrs:
        c.sendall(b"HTTP/1.1 426 Upgrade Required\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        return
    magic = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
    digest = hashlib.sha1((hdrs["sec-websocket-key"] + magic).encode()).digest()
    accept = base64.b64encode(digest).decode()
    extra = ""
    if "sec-websocket-protocol" in hdrs:
        extra = "Sec-WebSocket-Protocol: " + hdrs["sec-websocket-protocol"].split(",")[0].strip() + "\r\n"
    c.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               "Sec-WebSocket-Accept: " + accept + "\r\n" + extra + "\r\n").encode())
    f = c.makefile("rb")
    while True:
        h = f.read(2)
        if len(h) < 2:
            return
        op, ln = h[0] & 0x0F, h[1] & 0x7F
        if ln == 126:
            ln = struct.unpack("!H", f.read(2))[0]
        elif ln == 127:
            ln = struct.unpack("!Q", f.read(8))[0]
        mask = f.read(4) if h[1] & 0x80 else b"\0\0\0\0"
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(f.read(ln)))
        if op == 8:
            c.sendall(b"\x88\x02\x03\xe8")
            return
        if op in (1, 2):
            out = (b"echo:" + payload) if op == 1 else payload
            hdr = bytes([0x80 | op])
            if len(out) < 126:
                hdr += bytes([len(out)])
            elif len(out) < 65536:
                hdr += b"\x7e" + struct.pack("!H", len(out))
            else:
                hdr += b"\x7f" + struct.pack("!Q", len(out))
            c.sendall(hdr + out)

def ws_server(s):
    while True:
        c, _ = s.accept()
        threading.Thread(target=ws_client, args=(c,), daemon=True).start()

class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

ws = socket.socket()
ws.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ws.bind(("127.0.0.1", 8001))
ws.listen(16)
threading.Thread(target=ws_server, args=(ws,), daemon=True).start()
httpd = S(("0.0.0.0", 8000), H)
open("/tmp/servers-up", "w").write("up")
httpd.serve_forever()
"""
