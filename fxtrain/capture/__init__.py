"""Capture: turn a module call into FX graphs (dynamo front end, our backend)."""
