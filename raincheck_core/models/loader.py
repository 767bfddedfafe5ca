"""Read Hugging Face-format safetensors (single file or sharded) and map them onto our decoders by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..errors import CheckpointError

# Prefixes under which checkpoints store the text decoder, newest first. The LM head sits at the top.
TEXT_PREFIXES = ("model.language_model.", "model.", "language_model.model.")
HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
# Tensors that belong to parts we do not run: the vision tower (loaded by multimodal.vision) and
# Qwen3.5's multi-token-prediction head.
IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(f"{folder} is missing shard files: {', '.join(missing)}")
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def iter_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def _local_name(name: str) -> str | None:
    """Our parameter name for a checkpoint tensor name; None for tensors we do not own."""
    if name in HEAD_NAMES:
        return "lm_head.weight"
    if name.startswith(IGNORED_PREFIXES):
        return None
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def load_decoder_weights(model: nn.Module, folder: Path, tied: bool) -> dict[str, torch.Tensor]:
    """Copy every decoder tensor into `model` (casting to its dtype), strictly by name and shape.

    Returns the tensors we do not own (vision tower, …) so other loaders can use them.
    Raises CheckpointError naming the missing and unexpected tensors.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = set(params)
    if tied:
        expected.discard("lm_head.weight")
    seen: set[str] = set()
    unexpected: list[str] = []
    others: dict[str, torch.Tensor] = {}
    for name, tensor in iter_tensors(folder):
        local = _local_name(name)
        if local is None:
            others[name] = tensor
            continue
        if local == "lm_head.weight" and tied:
            continue  # some tied checkpoints still store the head; it equals the embedding
        if local not in params:
            unexpected.append(name)
            continue
        target = params[local]
        if tuple(target.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"tensor {name} has shape {tuple(tensor.shape)}, the config expects {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))
        seen.add(local)
    missing = sorted(expected - seen)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {folder} does not match its config", missing, unexpected)
    return others
