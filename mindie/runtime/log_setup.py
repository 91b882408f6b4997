"""Logging of every process of the server, set up the same way (LogConfig, docs/config.md).

- level: ``MINDIE_LOG_LEVEL`` (the launcher sets it from ``LogConfig.dynamicLogLevel``);
- format: ``MINDIE_LOG_FORMAT`` = ``text`` (default: ``time LEVEL [process] logger: message``) or
  ``json`` (one JSON object per line: ``time``, ``level``, ``process``, ``pid``, ``logger``,
  ``message``, plus the fields of a request line: mindie/server/request_log.py), from ``LogConfig.logFormat``;
- file: with ``MINDIE_LOG_PATH`` (``LogConfig.logPath``) each process also writes a file of its
  own (``log_file``), rotated at ``MINDIE_LOG_FILE_SIZE`` MB
  (``logFileSize``) keeping ``MINDIE_LOG_FILE_NUM`` old files (``logFileNum``). One file per
  process: several processes rotating one file would lose lines.

Everything also goes to stderr (the launcher's output, journald under systemd, the pod log).
"""
from __future__ import annotations

import datetime
import json
import logging
import logging.handlers
import os
import re
import sys

FORMATS = ("text", "json")


class JsonLineFormatter(logging.Formatter):
    """One JSON object per record; a request line's fields become keys of their own."""

    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
               .isoformat(timespec="milliseconds"),
               "level": record.levelname, "process": self.process, "pid": record.process, "logger": record.name,
               "message": record.getMessage()}
        fields = getattr(record, "request", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def text_formatter(process: str) -> logging.Formatter:
    return logging.Formatter(f"%(asctime)s %(levelname)s [{process}] %(name)s: %(message)s")


def log_file(log_path: str, process: str) -> str:
    """This process's file for ``LogConfig.logPath``: a MindIE file name (``logs/mindie-server.log``)
    gives ``logs/mindie-server-<process>-<pid>.log``; a directory gives
    ``<dir>/mindie-<process>-<pid>.log``. The directory is made (0750) if missing."""
    if log_path.endswith(".log"):
        directory, stem = os.path.dirname(log_path) or ".", os.path.basename(log_path)[:-4]
    else:
        directory, stem = log_path, "mindie"
    os.makedirs(directory, mode=0o750, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", process.split(" pid ")[0]).strip("-") or "process"
    return os.path.join(directory, f"{stem}-{name}-{os.getpid()}.log")


def setup_logging(process: str, level: str | int | None = None, env=os.environ) -> None:
    """Configure the root logger of this process (``process``: its label in every line, e.g.
    "frontend pid 123" or "worker w0 pid 456"). Replaces handlers set before."""
    level = level or (env.get("MINDIE_LOG_LEVEL") or "INFO").upper()
    fmt = (env.get("MINDIE_LOG_FORMAT") or "text").lower()
    formatter = JsonLineFormatter(process) if fmt == "json" else text_formatter(process)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    path = env.get("MINDIE_LOG_PATH")
    if path:
        handlers.append(logging.handlers.RotatingFileHandler(
            log_file(path, process), maxBytes=int(env.get("MINDIE_LOG_FILE_SIZE") or 20) << 20,
            backupCount=int(env.get("MINDIE_LOG_FILE_NUM") or 10), encoding="utf-8"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        h.setFormatter(formatter)
        root.addHandler(h)
    root.setLevel(level)
