"""Shardyard's Python SDK: `from shardyard.client import Client` (README, "Python SDK").

Only the standard library and httpx: no torch, no service code."""

from shardyard.client import Client
from shardyard.errors import ApiError, ShardyardError, Unreachable
from shardyard.results import (
    Job,
    LeaderboardRow,
    LogEvent,
    MetricEvent,
    NoticeEvent,
    Selection,
    StatusEvent,
    Trial,
    TrialEvent,
    Workspace,
)
from shardyard.stream import StreamTimeout

__all__ = [
    "ApiError",
    "Client",
    "Job",
    "LeaderboardRow",
    "LogEvent",
    "MetricEvent",
    "NoticeEvent",
    "Selection",
    "ShardyardError",
    "StatusEvent",
    "StreamTimeout",
    "Trial",
    "TrialEvent",
    "Unreachable",
    "Workspace",
]
