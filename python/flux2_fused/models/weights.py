"""Diffusers-format weight folders: read them one tensor at a time, write them for tests and tools.

A folder holds `config.json` and either one `diffusion_pytorch_model.safetensors` or several
`diffusion_pytorch_model-0000X-of-0000N.safetensors` shards listed by
`diffusion_pytorch_model.safetensors.index.json`. Loading streams tensor by tensor into a module built
on the meta device, so a 64 GB checkpoint never has a second full copy on the host. Every problem is
one `WeightsError` that names the file and the keys involved, raised before any tensor is read where
the headers alone can tell (missing, unexpected and mis-shaped keys).
"""

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = f"{WEIGHTS_NAME}.index.json"

# How many key names an error message lists before it only counts the rest.
_PREVIEW = 10


class WeightsError(ValueError):
    """A weights folder that cannot be loaded; the message names the file and the keys at fault."""


def _preview(names: Sequence[str]) -> str:
    """List names sorted, cut to the first few, so a message stays readable with 300 bad keys."""
    names = sorted(names)
    shown = ", ".join(names[:_PREVIEW])
    rest = len(names) - _PREVIEW
    return f"{shown} ... and {rest} more ({len(names)} in all)" if rest > 0 else shown


def read_json(path: Path) -> dict:
    """Read a JSON object, turning every way it can fail into one `WeightsError` naming the file."""
    if not path.is_file():
        raise WeightsError(f"{path} is missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise WeightsError(f"{path} is not valid JSON: {err}") from err
    except (OSError, UnicodeDecodeError) as err:
        raise WeightsError(f"{path} is unreadable: {err}") from err
    if not isinstance(data, dict):
        raise WeightsError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def read_config(folder: Path) -> dict:
    """The raw `config.json` dict of a weights folder (its keys are checked by the model's config)."""
    if not folder.is_dir():
        raise WeightsError(f"weights folder {folder} does not exist or is not a directory")
    return read_json(folder / CONFIG_NAME)


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files to read, in index order; the index wins over a lone single file."""
    index = folder / INDEX_NAME
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise WeightsError(f"{index} has no 'weight_map' object of key -> shard file name")
        names = list(dict.fromkeys(weight_map.values()))
        absent = [name for name in names if not (folder / name).is_file()]
        if absent:
            raise WeightsError(f"{index} names shard files missing from {folder}: {_preview(absent)}")
        return [folder / name for name in names]
    single = folder / WEIGHTS_NAME
    if single.is_file():
        return [single]
    raise WeightsError(f"no safetensors weights in {folder}: expected {WEIGHTS_NAME} or {INDEX_NAME}")


def _open(path: Path):  # safetensors does not export its handle type
    """Open a shard; a truncated or corrupt header fails here, so name the file in the error."""
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as err:
        raise WeightsError(f"{path} is not a readable safetensors file: {err}") from err


def _check_keys(module: torch.nn.Module, files: Sequence[Path]) -> None:
    """Compare the shards' headers with the module's parameters before reading any tensor data."""
    expected = {name: tuple(p.shape) for name, p in module.named_parameters()}
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in files:
        with _open(path) as shard:
            for key in shard.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if key in found:
                    raise WeightsError(f"key {key} is stored twice: in {found[key][0]} and in {path}")
                found[key] = (path, tuple(shard.get_slice(key).get_shape()))
    where = str(files[0]) if len(files) == 1 else f"the {len(files)} shards in {files[0].parent}"
    missing = expected.keys() - found.keys()
    if missing:
        raise WeightsError(f"{len(missing)} missing keys in {where}: {_preview(list(missing))}")
    unexpected = found.keys() - expected.keys()
    if unexpected:
        raise WeightsError(f"{len(unexpected)} unexpected keys in {where}: {_preview(list(unexpected))}")
    misshaped = [
        f"{key} in {found[key][0]} (expected {list(shape)}, found {list(found[key][1])})"
        for key, shape in expected.items()
        if found[key][1] != shape
    ]
    if misshaped:
        raise WeightsError(f"{len(misshaped)} mis-shaped keys: {_preview(misshaped)}")


def stream_into(
    module: torch.nn.Module,
    files: Sequence[Path],
    device: torch.device | str,
    dtype: torch.dtype | None,
) -> None:
    """Replace every parameter of `module` (typically on meta) by the shard tensors, one at a time.

    Each tensor is read, moved and cast, then assigned, so the host holds at most one tensor beyond
    the memory-mapped file. `dtype=None` keeps the dtype stored in the file.
    """
    _check_keys(module, files)
    for path in files:
        with _open(path) as shard:
            for key in shard.keys():  # noqa: SIM118 - safe_open handles are not iterable
                try:
                    tensor = shard.get_tensor(key)
                except (SafetensorError, OSError) as err:
                    raise WeightsError(f"{path}: cannot read tensor {key}: {err}") from err
                owner_name, _, attr = key.rpartition(".")
                owner = module.get_submodule(owner_name)
                old = getattr(owner, attr)
                value = tensor.to(device=device, dtype=dtype or tensor.dtype)
                setattr(owner, attr, torch.nn.Parameter(value, requires_grad=old.requires_grad))


def save_folder(
    state_dict: Mapping[str, torch.Tensor],
    config: Mapping[str, object],
    folder: Path,
    max_shard_bytes: int | None = None,
) -> None:
    """Write a diffusers-format folder: one file, or shards of at most `max_shard_bytes` plus an index.

    A tensor larger than the limit gets a shard of its own, as diffusers does.
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps(dict(config), indent=2) + "\n", encoding="utf-8")
    tensors = {key: t.detach().contiguous() for key, t in state_dict.items()}
    if max_shard_bytes is None:
        save_file(tensors, str(folder / WEIGHTS_NAME))
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    weight_map = {}
    stem = WEIGHTS_NAME.removesuffix(".safetensors")
    for number, shard in enumerate(shards, start=1):
        name = f"{stem}-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name))
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
