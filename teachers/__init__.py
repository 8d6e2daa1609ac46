"""Teacher servers and their client: the wire protocol (protocol.py), backends (backend.py,
hf_backend.py, vllm_backend.py), the server (server.py, its worker thread worker.py,
validate.py), the trainer's client (client.py, with results.py and batching.py), and process
helpers (serve.py for `opd serve-teacher`, launch.py to start one, lifecycle.py for what the
two share, keys.py for CURVE keys). See docs/protocol.md."""

from opd.teachers.client import FullChunk, TeacherClient, TeacherError, TopKResult

__all__ = ["TeacherClient", "TeacherError", "TopKResult", "FullChunk"]
