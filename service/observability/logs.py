"""The process's logs: plain lines, or with --json-output one JSON object per line, in
the shape of TGI's (tracing-subscriber's): `{"timestamp", "level", "fields": {"message",
...}, "target"}`, so that log pipelines built for TGI read textgen's too.

In JSON mode the lines Python's logging does not write are JSON too: warnings go through
logging (captureWarnings), Envoy's output is pumped into the `textgen.envoy` logger
(processes/envoy.py), progress bars are off (huggingface_hub's and transformers', through
HF_HUB_DISABLE_PROGRESS_BARS; the server's own, replica/assembly.py), and whatever else
reaches file descriptor 2 (gRPC's C core, torch's C++ warnings, a crash's traceback, child
processes) is wrapped, line by line, into a record of target `stderr` (`json_stderr`).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
from datetime import UTC, datetime

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record. A record's `fields` (logger.info(..., extra={"fields":
    {...}})) go in TGI's `fields` object, its `event` as the message."""

    def format(self, record: logging.LogRecord) -> str:
        extra = getattr(record, "fields", None) or {}
        # a structured record's message is its event's name: the rest is in its fields
        fields = {"message": extra.get("event") or record.getMessage(), **extra}
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        line = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="microseconds"
            ),
            "level": record.levelname,
            "fields": fields,
            "target": record.name,
        }
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(level: str, json_output: bool = False) -> None:
    """The root logger on stderr, at `level`, plain or JSON."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_output else logging.Formatter(PLAIN_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
    if json_output:
        json_stderr()
        logging.captureWarnings(True)
        _quiet_progress_bars()


_STDERR_LEVELS = {"E": "ERROR", "F": "CRITICAL", "W": "WARNING"}  # glog/absl's prefixes


def json_stderr() -> None:
    """Route file descriptor 2 through a pipe whose reader passes JSON lines on and wraps
    any other line into a JSON record: C libraries and child processes write there
    without asking Python's logging. Undone at exit, after the last line is out."""
    real = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    pump = threading.Thread(
        target=_pump_stderr, args=(read_end, real), name="textgen-stderr", daemon=True
    )
    pump.start()

    def restore() -> None:
        sys.stderr.flush()
        os.dup2(real, 2)  # the pipe's last writer here is gone: the pump reads to its end
        pump.join(timeout=2.0)

    atexit.register(restore)


def _pump_stderr(read_end: int, real: int) -> None:
    formatter = JsonFormatter()
    with os.fdopen(read_end, "rb") as lines, os.fdopen(real, "wb", buffering=0) as out:
        for raw in lines:
            text = raw.decode(errors="replace").rstrip("\n")
            if not text.strip():
                continue
            if not _is_json_object(text):
                level = _STDERR_LEVELS.get(text[:1], "INFO") if text[1:2].isdigit() else "INFO"
                record = logging.LogRecord("stderr", logging.getLevelName(level), "", 0, text,
                                           None, None)  # fmt: skip
                text = formatter.format(record)
            out.write(text.encode() + b"\n")


def _is_json_object(text: str) -> bool:
    if not text.startswith("{"):
        return False
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _quiet_progress_bars() -> None:
    """Downloads' and checkpoint loading's tqdm bars would be lines of their own. Both
    libraries read the variable when first imported (and shards inherit it)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "huggingface_hub" in sys.modules:  # imported already: tell it now
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def fail_line(prog: str, message: str, json_output: bool) -> str:
    """The one line a failed start prints: `prog: error: message`, or as a JSON log line."""
    if not json_output:
        return f"{prog}: error: {message}"
    record = logging.LogRecord(prog, logging.ERROR, "", 0, message, None, None)
    return JsonFormatter().format(record)
