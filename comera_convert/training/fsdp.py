"""FSDP2 for `comera train --fsdp`: a compressed model's parameters split across the workers.

Each repeated block, then the whole model, becomes an FSDP2 unit (``fully_shard``): the TT cores
and the dense rest are held as shards (Shard(0) DTensors) and gathered one block at a time for
forward and backward, so parameters, gradients and AdamW's state take 1/N of a device each. The
rank gates stay whole on every worker (``ignored_params``): the rank controller reads, sorts and
closes their entries after every step, and they are a few hundred numbers per layer; transformers'
Trainer broadcasts such replicated parameters at the start and averages their gradients.

What FSDP changes elsewhere:
  * the Trainer must neither wrap the model in DDP nor move it (``compat.mark_sharded``);
  * a truncated checkpoint is cut from the full parameters, gathered on the main worker into an
    unsharded twin of the model (``Sharding.full_model``: weights on the meta device until then);
  * AdamW's state is saved sharded, every worker its own part (torch.distributed.checkpoint), so
    nothing is held whole and a run can resume on another number of workers;
  * a resumed run loads its truncated checkpoint before the model is sharded (``expand_`` works on
    whole cores).
"""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..conversion.targets import find_blocks
from ..errors import ConfigError
from ..hf.compat import check_sharded_training, mark_sharded
from ..pipeline.spool import meta_parameter, replace_tensors
from ..pipeline.streaming import give_back_free_memory

OPTIMIZER_FOLDER = "optimizer_sharded"  # in a Trainer checkpoint, beside the truncated model


def world_size() -> int:
    """Workers of this run: torchrun's WORLD_SIZE (the process group may not be set up yet)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_fsdp_possible() -> None:
    """--fsdp splits the model across workers: refuse a single process, a torch without FSDP2's
    ``fully_shard`` (public from 2.6) and a transformers whose Trainer cannot train a model sharded
    before it."""
    if world_size() < 2:
        raise ConfigError("--fsdp shards the model across workers: start the run under torchrun with two or "
                          "more processes (torchrun --nproc_per_node N -m comera_convert train ... --fsdp)")
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        raise ConfigError(f"--fsdp shards with FSDP2's fully_shard, which torch has from 2.6; this one is "
                          f"{torch.__version__}") from None
    check_sharded_training()


def gate_parameters(model: nn.Module) -> set[nn.Parameter]:
    return {param for name, param in model.named_parameters() if ".gates." in f".{name}"}


def meta_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters are on the meta device (tied ones still tied) and whose
    buffers are copied: the skeleton the gathered weights are put into."""
    return copy.deepcopy(model, {id(p): meta_parameter(p) for p in model.parameters()})


def fill(twin: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put the gathered ``state`` into the twin's parameters; a parameter used in several places
    (tied weights) gets one tensor, found under any of its names."""

    names: dict[int, list[str]] = {}
    for name, param in twin.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)

    def gathered(param: nn.Parameter) -> nn.Parameter:
        found = next((state[n] for n in names[id(param)] if n in state), None)
        if found is None:
            raise KeyError(f"the gathered state has no {names[id(param)][0]}")
        return nn.Parameter(found, requires_grad=param.requires_grad)

    replace_tensors(twin, gathered)


class Sharding:
    """A model sharded with FSDP2 across the workers of the run, and (on the main worker) its
    unsharded twin for saving. The run was checked first (``check_fsdp_possible``)."""

    def __init__(self, model: nn.Module):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.twin = meta_twin(model) if dist.get_rank() == 0 else None
        device = next(model.parameters()).device
        mesh = init_device_mesh(device.type, (world_size(),))
        original_class, gates = type(model), gate_parameters(model)
        blocks = find_blocks(model)
        for block in (model.get_submodule(blocks) if blocks else ()):
            fully_shard(block, mesh=mesh, ignored_params=gates)
        fully_shard(model, mesh=mesh, ignored_params=gates)
        mark_sharded(model, world_size(), original_class)
        give_back_free_memory()  # the whole parameters, freed once their shards were cut
        # FSDP2 warns that the model returns views, on which an in-place op would skip its backward
        # hook: the objectives only read the outputs.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

    def full_model(self, model: nn.Module) -> nn.Module | None:
        """The model with every parameter whole, on the CPU: on the main worker, None elsewhere.
        Every worker must call it (the shards are gathered)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.twin is None:
            return None
        fill(self.twin, state)
        return self.twin

    @staticmethod
    def save_optimizer(model: nn.Module, optimizer, folder: Path) -> None:
        """AdamW's state, each worker writing its own shards (every worker calls it)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=str(Path(folder) / OPTIMIZER_FOLDER))

    @staticmethod
    def load_optimizer(model: nn.Module, optimizer, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}  # the layout to read into
        dcp.load(state, checkpoint_id=str(Path(folder) / OPTIMIZER_FOLDER))
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
