"""Load Hugging Face safetensors checkpoints into a (possibly tensor-parallel) model.

Tensors are opened lazily (``get_slice``) and handed to each parameter's ``weight_loader``,
which reads only this rank's rows or columns: no rank materialises a weight it does not own,
and peak host memory stays around one shard of one tensor. Checkpoint names map onto model
parameters one to one, except the projections the model packs together (the model's
``packed_modules_mapping``: ``q_proj`` -> ``qkv_proj`` shard ``"q"`` and so on).
"""
from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Hashable

from safetensors import SafetensorError, safe_open
from torch import nn

from kvscope.layers.sharding import default_weight_loader

# RoPE buffers some checkpoints saved (older transformers; ColossalAI's cos/sin tables), as vLLM skips them
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's map of tensors to files


class CheckpointMismatchError(ValueError):
    """The checkpoint and the model disagree: a tensor is missing, unexpected or misshapen."""


def _to_param_name(ckpt_name: str, mapping: dict[str, tuple[str, Hashable]]
                   ) -> tuple[str, Hashable]:
    parts = ckpt_name.split(".")
    for i, part in enumerate(parts):
        if part in mapping:
            packed, shard_id = mapping[part]
            return ".".join(parts[:i] + [packed] + parts[i + 1:]), shard_id
    return ckpt_name, None


def _to_ckpt_name(param_name: str, shard_id: Hashable,
                  mapping: dict[str, tuple[str, Hashable]]) -> str:
    if shard_id is None:
        return param_name
    parts = param_name.split(".")
    for original, (packed, sid) in mapping.items():
        if sid == shard_id and packed in parts:
            i = parts.index(packed)
            return ".".join(parts[:i] + [original] + parts[i + 1:])
    return f"{param_name}[{shard_id}]"


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Fill every parameter of ``model`` from the checkpoint's safetensors files
    (:func:`checkpoint_files`).

    Raises :class:`CheckpointMismatchError` naming the tensor when the checkpoint lacks one the
    model needs, holds one the model does not know, or has the wrong shape. With tied word
    embeddings a checkpoint ``lm_head.weight`` (if any) is ignored.
    """
    files = checkpoint_files(model_dir)
    mapping = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model, "tie_word_embeddings", False)
    params = dict(model.named_parameters())
    expected = {(name, sid) for name, p in params.items()
                for sid in getattr(p, "shard_ids", (None,))}
    loaded: set[tuple[str, Hashable]] = set()
    for file in files:
        try:
            _load_file(file, params, mapping, tied, loaded)
        except SafetensorError as e:  # (a cut download, or not safetensors at all)
            raise CheckpointMismatchError(f"{file} is not a whole safetensors file: {e}") from e
    missing = sorted(_to_ckpt_name(n, s, mapping) for n, s in expected - loaded)
    if missing:
        raise CheckpointMismatchError(f"checkpoint {model_dir} lacks {len(missing)} tensor(s): "
                                      f"{', '.join(missing)}")


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of the model: where an index maps its tensors to files, the files it
    names, as transformers and vLLM read them (a file beside the shards, such as the
    ``consolidated.safetensors`` Mistral's repositories ship, is not part of the model); else
    every ``*.safetensors`` file of the directory."""
    directory = Path(model_dir)
    index = directory / INDEX_FILE
    if not index.is_file():
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
        return files
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointMismatchError(f"{index} is not a safetensors index (a weight_map of tensor "
                                      f"names to files): {e!r}") from e
    absent = [name for name in names if not (directory / name).is_file()]
    if absent:
        raise CheckpointMismatchError(f"{index} names {len(absent)} file(s) that {model_dir} lacks: "
                                      f"{', '.join(absent)}")
    return [directory / name for name in names]


def _load_file(file: Path, params: dict[str, nn.Parameter], mapping: dict, tied: bool,
               loaded: set[tuple[str, Hashable]]) -> None:
    """Load one safetensors file's tensors into ``params``, adding what it filled to ``loaded``."""
    with safe_open(str(file), framework="pt", device="cpu") as st:
        for ckpt_name in st.keys():
            if ckpt_name.endswith(IGNORED_SUFFIXES) or (tied and ckpt_name == "lm_head.weight"):
                continue
            name, shard_id = _to_param_name(ckpt_name, mapping)
            if name not in params:
                raise CheckpointMismatchError(
                    f"unexpected checkpoint tensor {ckpt_name!r} in {file.name}: "
                    f"the model has no parameter {name!r}")
            if (name, shard_id) in loaded:
                raise CheckpointMismatchError(f"checkpoint tensor {ckpt_name!r} appears twice")
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, st.get_slice(ckpt_name), shard_id)
            except ValueError as e:
                raise CheckpointMismatchError(f"{ckpt_name}: {e}") from e
            loaded.add((name, shard_id))
