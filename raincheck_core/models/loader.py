"""Read Hugging Face-format safetensors (single file or sharded) and map them onto our decoders by name."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..errors import CheckpointError, NoMtpHeadError
from ..layers.linear import MergedLinear
from ..layers.parallel import Target, copy_into, rows_of

# Prefixes under which checkpoints store the text decoder, newest first. The LM head sits at the top.
TEXT_PREFIXES = ("model.language_model.", "model.", "language_model.model.")
HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
# Prefixes of Qwen3.5's multi-token-prediction head (models/mtp.py; `load_mtp_weights`), top level as released
MTP_PREFIXES = ("mtp.", "model.mtp.")
# Tensors that belong to parts the decoder does not run: the vision tower (loaded by multimodal.vision) and
# the MTP head.
IGNORED_PREFIXES = ("model.visual.", "visual.", *MTP_PREFIXES)


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


def _targets(model: nn.Module) -> dict[str, Target]:
    """Checkpoint-side parameter name -> how to read and write it (layers/parallel.py `Target`). Merged
    projections expose one name per part (`…self_attn.q_proj.weight`), exactly as checkpoints store them;
    modules with `checkpoint_targets` (MoE experts, tensor-parallel layers) their own names, layouts and
    the slices this rank reads."""
    targets: dict[str, Target] = {}
    merged = {name: m for name, m in model.named_modules() if isinstance(m, MergedLinear)}
    for name, module in merged.items():
        parent = name.rsplit(".", 1)[0]
        for part_leaf in module.part_names():
            part, leaf = part_leaf.split(".")
            targets[f"{parent}.{part_leaf}"] = Target(
                (module.part_shape(part, leaf),),
                lambda t, m=module, p=part, lf=leaf: m.load_part(p, lf, t),
                rows_of(module.select[part]),
            )
    custom = {name: m for name, m in model.named_modules() if hasattr(m, "checkpoint_targets")}
    for name, module in custom.items():
        prefix = f"{name}." if name else ""
        targets.update({prefix + local: target for local, target in module.checkpoint_targets().items()})
    for name, param in model.named_parameters(remove_duplicate=False):
        if name.rsplit(".", 1)[0] in merged.keys() | custom.keys():
            continue
        # a module's checkpoint_targets may name its children's parameters (a GDN layer's conv weight)
        targets.setdefault(name, Target((tuple(param.shape),), copy_into(param)))
    return targets


def load_decoder_weights(model: nn.Module, folder: Path, tied: bool) -> dict[str, torch.Tensor]:
    """Copy every decoder tensor into `model` (casting to its dtype), strictly by name and shape.

    Returns the tensors we do not own (vision tower, …) so other loaders can use them.
    Raises CheckpointError naming the missing and unexpected tensors.
    """
    targets = _targets(model)
    expected = set(targets)
    if tied:
        expected.discard("lm_head.weight")
    seen: set[str] = set()
    unexpected: list[str] = []
    others: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                local = _local_name(name)
                if local is None:
                    others[name] = f.get_tensor(name)
                    continue
                if local == "lm_head.weight" and tied:
                    continue  # some tied checkpoints still store the head; it equals the embedding
                if local not in targets:
                    unexpected.append(name)
                    continue
                _copy(f, name, targets[local])
                seen.add(local)
    missing = sorted(expected - seen)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {folder} does not match its config", missing, unexpected)
    return others


def load_mtp_weights(head: nn.Module, folder: Path) -> None:
    """Copy the checkpoint's `mtp.*` tensors into `head` (models/mtp.py `MtpHead`), strictly by name and
    shape. Raises NoMtpHeadError where the checkpoint has none, CheckpointError naming the missing and
    unexpected ones where they do not match the head."""
    targets = _targets(head)
    seen: set[str] = set()
    unexpected: list[str] = []
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                prefix = next((p for p in MTP_PREFIXES if name.startswith(p)), None)
                if prefix is None:
                    continue
                local = name[len(prefix):]
                if local not in targets:
                    unexpected.append(name)
                    continue
                _copy(f, name, targets[local])
                seen.add(local)
    if not seen and not unexpected:
        raise NoMtpHeadError(
            f"checkpoint {folder} has no multi-token-prediction head (no mtp.* tensors): MTP speculative "
            "decoding needs a Qwen3.5 checkpoint that ships one; prompt-lookup (n-gram) drafts need none")
    missing = sorted(set(targets) - seen)
    if missing or unexpected:
        raise CheckpointError(f"the MTP head of checkpoint {folder} does not match its config",
                              [f"mtp.{m}" for m in missing], unexpected)


def _copy(f, name: str, target: Target) -> None:
    """Checkpoint tensor `name` of the open file `f` into its target, read as a slice (a tensor-parallel
    rank reads only its part of the tensor)."""
    part = f.get_slice(name)
    shape = tuple(part.get_shape())
    if shape not in target.shapes:
        raise CheckpointError(f"tensor {name} has shape {shape}, the config expects {target.shapes[0]}")
    if target.write is not None:
        target.write(target.read(part))
