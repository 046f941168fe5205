"""Profiler: the cost of a training step (FLOPs, memory, per module) from a run on fake tensors."""
from .entry import profile
from .inputs import fake_inputs, shapes_only
from .report import ModuleCost, ProfileReport, UnknownOp
from ..cost.tracker import ProfileError

__all__ = ["profile", "fake_inputs", "shapes_only", "ProfileReport", "ModuleCost", "UnknownOp", "ProfileError"]
