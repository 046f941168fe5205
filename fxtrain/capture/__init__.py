"""Capture: turn a module call into FX graphs (dynamo front end, our backend)."""
from .info import CaptureInfo, GraphRecord
from .state import capturing, is_capturing

__all__ = ["CaptureInfo", "GraphRecord", "capturing", "is_capturing"]
