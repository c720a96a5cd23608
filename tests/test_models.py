"""Model names: aliases resolve to what the user means, and load from the local Hugging Face cache."""

import json
import socket

import huggingface_hub
import huggingface_hub.constants
import pytest

from comera_convert.errors import ModelLoadError
from comera_convert.models import read_config, resolve


def _cached_model(cache, repo_id, config):
    """A hub id's config.json laid out as the Hugging Face cache holds a downloaded model."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abc")
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))


@pytest.fixture(autouse=True)
def _nothing_fetched(tmp_path_factory, monkeypatch):
    """Each test starts on a machine where no fetch script has run (a test that needs one fetches)."""
    from comera_convert import models

    monkeypatch.setattr(models, "FETCH_ROOT", tmp_path_factory.mktemp("fetched"))


@pytest.mark.parametrize("alias", ["mpnet", "all-mpnet-base-v2"])
def test_the_mpnet_aliases_read_sentence_transformers_model_from_the_cache(alias, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    _cached_model(tmp_path, "sentence-transformers/all-mpnet-base-v2", {"model_type": "mpnet", "hidden_size": 768})
    assert read_config(resolve(alias)) == {"model_type": "mpnet", "hidden_size": 768}


def test_an_alias_missing_from_the_cache_says_so_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="sentence-transformers/all-mpnet-base-v2.*offline"):
        read_config(resolve("mpnet"))


def test_a_local_directory_wins_over_an_alias(tmp_path, monkeypatch):
    (tmp_path / "mpnet").mkdir()
    (tmp_path / "mpnet" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve("mpnet") == "mpnet"


def test_a_hub_id_without_network_fails_at_once_instead_of_retrying(tmp_path, monkeypatch):
    """With the hub's host unresolvable, the download (which retries for over a minute) is never tried."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    real_download = huggingface_hub.hf_hub_download

    def download(*args, local_files_only=False, **kwargs):
        assert local_files_only, "downloaded with no network"
        return real_download(*args, local_files_only=True, **kwargs)

    def no_network(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    with pytest.raises(ModelLoadError, match=r"'sentence-transformers/all-mpnet-base-v2' was found neither on disk "
                                             r"nor in the Hugging Face cache \(ConnectionError\); .*offline"):
        read_config(resolve("mpnet"))
    # Cached, the model is read without asking the network at all.
    _cached_model(tmp_path, "sentence-transformers/all-mpnet-base-v2", {"model_type": "mpnet"})
    assert read_config(resolve("mpnet")) == {"model_type": "mpnet"}


def test_an_alias_finds_the_folder_its_fetch_script_made_before_the_hub(tmp_path, monkeypatch):
    from comera_convert import models

    monkeypatch.setattr(models, "FETCH_ROOT", tmp_path)
    assert models.resolve("mpnet") == "sentence-transformers/all-mpnet-base-v2"  # not fetched: the hub id
    (tmp_path / "all-mpnet-base-v2").mkdir()
    (tmp_path / "all-mpnet-base-v2" / "config.json").write_text("{}")
    assert models.resolve("mpnet") == models.resolve("all-mpnet-base-v2") == str(tmp_path / "all-mpnet-base-v2")
    assert models.resolve("bert-base") == "google-bert/bert-base-uncased"
