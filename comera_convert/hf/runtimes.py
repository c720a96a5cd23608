"""What the exports and the timing of serving forms share of the runtimes: compiling and running an
OpenVINO graph, and quieting NNCF and torch's ONNX exporter, which print their progress."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import numpy as np


def compile_graph(graph, config: dict | None = None):
    """``graph`` (a file, or an ``openvino.Model``) compiled for this machine's CPU, answering one request at a
    time with all its cores (what optimum-intel asks of OpenVINO by default)."""
    import openvino

    source = str(graph) if isinstance(graph, (str, Path)) else graph
    return openvino.Core().compile_model(source, "CPU", {"PERFORMANCE_HINT": "LATENCY", **(config or {})})


def run_graph(compiled, feeds: dict) -> np.ndarray:
    """The compiled graph's first output on ``feeds`` (numpy arrays by input name; token type ids as zeros
    where the graph takes them and none are given)."""
    return compiled({port.get_any_name(): graph_input(feeds, port.get_any_name()) for port in compiled.inputs})[0]


def graph_input(encoded, name: str) -> np.ndarray:
    """Input ``name`` of a graph from tokenizer output (token type ids as zeros where none are given)."""
    if name == "token_type_ids" and name not in encoded:
        return np.zeros_like(np.asarray(encoded["input_ids"]))
    return np.asarray(encoded[name])


@contextlib.contextmanager
def quiet_nncf():
    """NNCF draws progress bars and logs each step; the export reports its own progress."""
    logger = logging.getLogger("nncf")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def quiet_exporter():
    """The exporter prints its progress and warns about optional packages; none of it is the user's."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "onnxscript")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
