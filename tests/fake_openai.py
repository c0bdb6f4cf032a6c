"""A local OpenAI-compatible chat-completions endpoint for the judge tests.

Subclass :class:`ChatHandler`, override :meth:`ChatHandler.reply`, and serve it with :func:`serve`
(a context manager yielding the ``.../v1`` base URL).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import threading


class ChatHandler(http.server.BaseHTTPRequestHandler):
  """POST handler: ``reply(path, authorization, body) -> (status, json dict or None)``."""

  def reply(self, path: str, auth: str | None, body: dict) -> tuple[int, dict | None]:
    raise NotImplementedError  # each test's handler says what the judge answers

  def do_POST(self):  # noqa: N802 - http.server API
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    status, obj = self.reply(self.path, self.headers.get("Authorization"), body)
    data = b"" if obj is None else json.dumps(obj).encode()
    self.send_response(status)
    if obj is not None:
      self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def log_message(self, *args):
    pass


@contextlib.contextmanager
def serve(handler: type[ChatHandler]):
  """Serve ``handler`` on a free local port in a daemon thread; yields the base URL."""
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    yield f"http://127.0.0.1:{server.server_port}/v1"
  finally:
    server.shutdown()
