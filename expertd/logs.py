"""Logging: plain lines for people, or one JSON object a line for collectors
(with the request id, when a record carries one).

Log records carry what clients sent (request ids, trace ids, error text about their
requests). Neither form lets that forge a line: in text, control characters
(newlines included) are written as escapes and a traceback's lines are indented, so
a line that starts at column 0 is always a record's first; in JSON, the encoder
escapes them. Long strings from a record's arguments are cut to MAX_FIELD chars.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time

MAX_FIELD = 512  # characters kept of one string argument or extra field
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(char: str) -> str:
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def escape(text: str) -> str:
    """Control characters as visible escapes: one line, whatever `text` holds."""
    return _CONTROL.sub(lambda m: _escaped(m[0]), text)


def clip(value):
    """A long string cut to MAX_FIELD characters (what follows counted); others as is."""
    if isinstance(value, str) and len(value) > MAX_FIELD:
        return f"{value[:MAX_FIELD]}...({len(value) - MAX_FIELD} more chars)"
    return value


def _message(record: logging.LogRecord) -> str:
    if isinstance(record.args, tuple):
        record.args = tuple(clip(a) for a in record.args)
    elif isinstance(record.args, dict):
        record.args = {k: clip(v) for k, v in record.args.items()}
    return record.getMessage()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.message = escape(_message(record))
        record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        if record.exc_info:
            trace = self.formatException(record.exc_info)
            line += "".join(f"\n    {escape(part)}" for part in trace.splitlines())
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": _message(record),
        }
        entry.update({k: clip(v) for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def _log_uncaught_in_thread(args) -> None:
    """Exceptions that end a thread, as log records (in the chosen form), not raw text."""
    if args.exc_type is SystemExit:
        return
    logging.getLogger("expertd").error(
        "uncaught exception in thread %s",
        args.thread.name if args.thread else "?",
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )


def _log_uncaught(exc_type, exc_value, exc_traceback) -> None:
    logging.getLogger("expertd").critical(
        "uncaught exception", exc_info=(exc_type, exc_value, exc_traceback)
    )


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (it may be replaced after setup,
    as test runners do), not the stream it was when logging was set up."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # warnings too, in the same form
    threading.excepthook = _log_uncaught_in_thread
    sys.excepthook = _log_uncaught
