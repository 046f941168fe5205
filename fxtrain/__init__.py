"""fxtrain: capture a PyTorch model's training step as a graph, then run, cost and split it."""
from .capture_state import is_capturing
from .errors import Error, FxtrainWarning
from .module import CaptureError, FallbackWarning, TrainModule
from .module_with_loss import ModuleWithLoss
from .options import Options
from .profile import ProfileReport, fake_inputs, profile, shapes_only
from .pipeline import Pipe, PipelineError, SplitError, pipe_split, split
from .runtime.deferred import StaleDeferredOutput
from .runtime.dense_route import SparseBatchError
from .version import __version__

__all__ = ["TrainModule", "ModuleWithLoss", "Options", "is_capturing", "profile", "ProfileReport", "fake_inputs",
           "shapes_only", "Error", "FxtrainWarning", "CaptureError", "FallbackWarning", "__version__",
           "split", "pipe_split", "Pipe", "PipelineError", "SplitError", "SparseBatchError", "StaleDeferredOutput"]
