"""Serving a local model over an OpenAI-compatible HTTP API (``turnrl serve``)."""

from turnrl.serving.server import ChatService, make_server, serve

__all__ = ["ChatService", "make_server", "serve"]
