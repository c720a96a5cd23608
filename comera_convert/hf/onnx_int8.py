"""int8 ONNX graphs as sentence-transformers makes them: dynamic quantization by onnxruntime.

sentence-transformers' ``export_dynamic_quantized_onnx_model(model, "avx512_vnni", ...)`` runs optimum's
``ORTQuantizer`` with one of four per-architecture configurations, and optimum hands them to
onnxruntime's ``quantize_dynamic``: weights int8 per output channel (uint8 on ``avx2``), activations
uint8, quantized as they come, full range, every operator onnxruntime has an integer kernel for. The
same call here quantizes a compressed graph exactly as the dense model's export is quantized, without
optimum, and names the file as sentence-transformers does (``model_qint8_<arch>.onnx``), so that
``SentenceTransformer(path, backend="onnx", model_kwargs={"file_name": "onnx/model_qint8_avx512_vnni.onnx"})``
finds it.
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path

from ..errors import ConfigError, expected

# The architectures sentence-transformers names its int8 files after, most capable first, and the
# weight type each one's kernels take (avx2's integer GEMM multiplies unsigned weights).
WEIGHT_TYPES = {"avx512_vnni": "QInt8", "avx512": "QInt8", "avx2": "QUInt8", "arm64": "QInt8"}
ARCHES = tuple(WEIGHT_TYPES)
CPU_FLAGS = "/proc/cpuinfo"


def int8_file_name(arch: str) -> str:
    """The file name sentence-transformers gives an int8 graph for ``arch``."""
    check_arch(arch)
    return f"model_qint8_{arch}.onnx"


def check_arch(arch: str) -> str:
    if arch not in WEIGHT_TYPES:
        raise ConfigError(f"--arch: {expected('one of ' + ', '.join(ARCHES), arch)}")
    return arch


def this_machine_arch() -> str:
    """The most capable of ``ARCHES`` this CPU runs: arm64 on ARM, else read from the CPU's flags
    (avx2 where they cannot be read)."""
    if platform.machine().lower() in ("arm64", "aarch64"):
        return "arm64"
    try:
        flags = set(Path(CPU_FLAGS).read_text().split())
    except OSError:
        return "avx2"
    if "avx512_vnni" in flags:
        return "avx512_vnni"
    return "avx512" if "avx512f" in flags else "avx2"


def require_onnxruntime(what: str) -> None:
    """Refuse ``what`` in one line naming the extra where onnxruntime is not installed."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        raise ConfigError(f"{what} needs onnxruntime: pip install 'comera-convert[onnx]'") from None


def quantize_int8(source: Path, target: Path, arch: str) -> None:
    """Write ``source``'s graph with int8 weights to ``target``, as sentence-transformers' export for
    ``arch`` does."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quiet = logging.getLogger()  # onnxruntime suggests its pre-processing on the root logger
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        quantize_dynamic(str(source), str(target), per_channel=True, reduce_range=False,
                         weight_type=getattr(QuantType, WEIGHT_TYPES[check_arch(arch)]))
    finally:
        quiet.setLevel(level)
