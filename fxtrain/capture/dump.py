"""Debug dumps: what was captured, as code a person can read (``Options.save_graphs_dir``)."""
from __future__ import annotations

import json
import logging
import os
from typing import Optional

import torch.fx

from ..runtime.info import CaptureInfo, GraphRecord

logger = logging.getLogger("fxtrain")


def _readable(gm: Optional[torch.fx.GraphModule]) -> Optional[str]:
    if gm is None:
        return None
    return gm.print_readable(print_output=False, include_stride=False, include_device=True)


def dump_capture(root: str, owner: str, info: CaptureInfo, record: GraphRecord) -> str:
    """Write one folder for ``record``; failures to write are logged, never raised (it is a debug aid)."""
    folder = os.path.join(root, f"{owner}-{record.index:03d}-{record.mode}")
    files = {"dynamo_graph.py": _readable(record.dynamo_graph),
             "forward_graph.py": _readable(record.forward_graph),
             "backward_graph.py": _readable(record.backward_graph)}
    summary = {"index": record.index, "mode": record.mode, "executor": info.executor,
               "optimizations": record.optimizations, "python_ops": list(info.python_ops),
               "nodes": {name: len(gm.graph.nodes) for name, gm in
                         (("dynamo", record.dynamo_graph), ("forward", record.forward_graph),
                          ("backward", record.backward_graph)) if gm is not None},
               "note": None if record.forward_graph is not None else
               f"the {info.executor} executor does not expose its aten graphs"}
    try:
        os.makedirs(folder, exist_ok=True)
        for name, text in files.items():
            if text is not None:
                with open(os.path.join(folder, name), "w") as f:
                    f.write(text)
        with open(os.path.join(folder, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    except OSError as e:
        logger.warning("fxtrain: could not write graphs to %s: %s", folder, e)
    else:
        logger.info("fxtrain: wrote capture %d to %s", record.index, folder)
    return folder
