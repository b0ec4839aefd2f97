"""CPU tests of the eager FLUX.2 transformer: bit-exact diffusers parity, weight loading, random init."""

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flux2_fused.bench.hosts import diffusers_model
from flux2_fused.models.flux2 import Flux2Config, Flux2Transformer, image_ids, text_ids
from flux2_fused.models.weights import INDEX_NAME, WEIGHTS_NAME, WeightsError

diffusers_flux2 = pytest.importorskip("diffusers.models.transformers.transformer_flux2")
attention_backend = pytest.importorskip("diffusers.models.attention_dispatch").attention_backend

TINY = Flux2Config.preset("tiny")
N_IMG, N_TXT = 37, 11  # odd counts: no row count is a multiple of any vector width


def make_inputs(config: Flux2Config, batch: int, dtype: torch.dtype, guidance: bool, seed: int = 1) -> dict:
    """Fresh random inputs in diffusers' keyword names (timesteps in (0, 1), guidance in (1, 5))."""
    gen = torch.Generator().manual_seed(seed)
    text = torch.randn(batch, N_TXT, config.joint_attention_dim, generator=gen)
    return {
        "hidden_states": torch.randn(batch, N_IMG, config.in_channels, generator=gen).to(dtype),
        "encoder_hidden_states": text.to(dtype),
        "timestep": torch.rand(batch, generator=gen),
        "img_ids": image_ids(N_IMG),
        "txt_ids": text_ids(N_TXT),
        "guidance": 1 + 4 * torch.rand(batch, generator=gen) if guidance else None,
    }


def run_both(ours: Flux2Transformer, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Both models' outputs; diffusers pinned to its native (SDPA) attention backend."""
    reference = diffusers_model(ours)
    with torch.inference_mode(), attention_backend("native"):
        return ours(**inputs), reference(**inputs, return_dict=False)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("guidance_embeds", [True, False], ids=["guidance", "no-guidance"])
def test_parity_with_diffusers(dtype: torch.dtype, batch: int, guidance_embeds: bool) -> None:
    config = dataclasses.replace(TINY, guidance_embeds=guidance_embeds)
    ours = Flux2Transformer.random(config, seed=3, dtype=dtype)
    ours_out, ref_out = run_both(ours, make_inputs(config, batch, dtype, guidance=guidance_embeds))
    assert ours_out.shape == (batch, N_IMG, config.out_channels)
    assert ours_out.dtype == dtype
    assert torch.equal(ours_out, ref_out)


def test_parity_batched_ids_and_ignored_guidance() -> None:
    """[B, S, 4] ids use the first batch's ids; guidance without a guidance embedder is ignored."""
    config = dataclasses.replace(TINY, guidance_embeds=False)
    ours = Flux2Transformer.random(config, dtype=torch.bfloat16)
    inputs = make_inputs(config, 2, torch.bfloat16, guidance=True)
    inputs["img_ids"] = torch.stack([inputs["img_ids"], inputs["img_ids"] + 5])
    inputs["txt_ids"] = torch.stack([inputs["txt_ids"], inputs["txt_ids"] + 5])
    ours_out, ref_out = run_both(ours, inputs)
    assert torch.equal(ours_out, ref_out)
    with torch.inference_mode():
        assert torch.equal(ours_out, ours(**{**inputs, "guidance": None}))


def test_fp16_clipping_parity() -> None:
    """Gates big enough to overflow fp16 at the text FFN residual and each single-block residual: both
    models must saturate at the same places and agree bit for bit."""
    ours = Flux2Transformer.random(TINY, seed=5, dtype=torch.float16)
    dim = TINY.inner_dim
    with torch.no_grad():
        ours.double_stream_modulation_txt.linear.weight[5 * dim :] *= 1e5  # c_gate_mlp
        ours.single_stream_modulation.linear.weight[2 * dim :] *= 1e5  # gate
    peaks = []
    text_stream, last_single = ours.transformer_blocks[0], ours.single_transformer_blocks[-1]
    hooks = [
        text_stream.register_forward_hook(
            lambda m, i, out: peaks.append(out[0].abs().max())
        ),  # (text, image)
        last_single.register_forward_hook(lambda m, i, out: peaks.append(out.abs().max())),
    ]
    ours_out, ref_out = run_both(ours, make_inputs(TINY, 2, torch.float16, guidance=True))
    for hook in hooks:
        hook.remove()
    assert [p.item() for p in peaks] == [65504.0, 65504.0]
    assert ours_out.isfinite().all()
    assert torch.equal(ours_out, ref_out)


def test_random_output_is_finite_and_not_degenerate() -> None:
    ours = Flux2Transformer.random(TINY, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = ours(**make_inputs(TINY, 2, torch.bfloat16, guidance=True)).float()
    assert out.isfinite().all()
    assert 0.1 < out.std().item() < 10
    assert not torch.equal(out[0], out[1])


def test_random_is_deterministic() -> None:
    first = Flux2Transformer.random(TINY, seed=7).state_dict()
    again = Flux2Transformer.random(TINY, seed=7).state_dict()
    other = Flux2Transformer.random(TINY, seed=8).state_dict()
    assert all(torch.equal(first[key], again[key]) for key in first)
    linears = [key for key, tensor in first.items() if tensor.ndim == 2]
    assert all(not torch.equal(first[key], other[key]) for key in linears)
    assert all(first[key].device.type == "cpu" for key in first)


def test_state_dict_round_trip_both_ways() -> None:
    reference = diffusers_flux2.Flux2Transformer2DModel(**TINY.to_diffusers())
    ours = Flux2Transformer.random(TINY, seed=2)
    ours.load_state_dict(reference.state_dict(), strict=True)
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in reference.state_dict().items())
    fresh = Flux2Transformer.random(TINY, seed=9)
    reference.load_state_dict(fresh.state_dict(), strict=True)
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize(
    ("name", "keys", "params"),
    [("dev", 331, 32.22e9), ("klein-4b", 169, 3.88e9), ("klein-9b", 233, 9.08e9)],
)
def test_presets_match_diffusers_shapes(name: str, keys: int, params: float) -> None:
    config = Flux2Config.preset(name)
    with torch.device("meta"):
        ours = Flux2Transformer(config)
        reference = diffusers_flux2.Flux2Transformer2DModel(**config.to_diffusers())
    shapes = {key: tuple(t.shape) for key, t in ours.state_dict().items()}
    assert shapes == {key: tuple(t.shape) for key, t in reference.state_dict().items()}
    assert len(shapes) == keys
    assert round(sum(p.numel() for p in ours.parameters()) / 1e9, 2) == params / 1e9


def test_config_diffusers_dict_round_trip() -> None:
    raw = {"_class_name": "Flux2Transformer2DModel", "_diffusers_version": "0.42.1", **TINY.to_diffusers()}
    assert Flux2Config.from_diffusers(json.loads(json.dumps(raw))) == TINY
    assert Flux2Config.from_diffusers({"out_channels": None}) == Flux2Config.preset("dev")
    with pytest.raises(ValueError, match="unknown preset"):
        Flux2Config.preset("pro")


@pytest.mark.parametrize("max_shard_bytes", [None, 40_000], ids=["single-file", "sharded"])
def test_from_pretrained_round_trip(tmp_path: Path, max_shard_bytes: int | None) -> None:
    ours = Flux2Transformer.random(TINY, seed=4)
    ours.save_pretrained(tmp_path, max_shard_bytes=max_shard_bytes)
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) == 1 if max_shard_bytes is None else len(shards) > 2
    assert (tmp_path / INDEX_NAME).is_file() == (max_shard_bytes is not None)

    loaded = Flux2Transformer.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.config == TINY
    expected = {key: t.to(torch.bfloat16) for key, t in ours.state_dict().items()}
    assert all(torch.equal(t, expected[key]) for key, t in loaded.state_dict().items())
    assert not any(p.is_meta for p in loaded.parameters())

    reference = diffusers_flux2.Flux2Transformer2DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    inputs = make_inputs(TINY, 1, torch.bfloat16, guidance=True)
    with torch.inference_mode():
        assert torch.equal(loaded(**inputs), reference(**inputs, return_dict=False)[0])


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A valid sharded tiny folder that each malformed-folder test breaks in one way."""
    Flux2Transformer.random(TINY).save_pretrained(tmp_path, max_shard_bytes=40_000)
    return tmp_path


def first_shard(folder: Path) -> Path:
    return folder / json.loads((folder / INDEX_NAME).read_text())["weight_map"]["x_embedder.weight"]


def rewrite_first_shard(folder: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    path = first_shard(folder)
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_error_folder_missing(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="nowhere does not exist"):
        Flux2Transformer.from_pretrained(tmp_path / "nowhere")


def test_error_config_missing(folder: Path) -> None:
    (folder / "config.json").unlink()
    with pytest.raises(WeightsError, match=r"config\.json is missing"):
        Flux2Transformer.from_pretrained(folder)


def test_error_config_invalid_json(folder: Path) -> None:
    (folder / "config.json").write_text('{"num_layers": 2,')
    with pytest.raises(WeightsError, match=r"config\.json is not valid JSON"):
        Flux2Transformer.from_pretrained(folder)


def test_error_config_not_an_object(folder: Path) -> None:
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(WeightsError, match=r"config\.json must hold a JSON object"):
        Flux2Transformer.from_pretrained(folder)


def test_error_config_unknown_key(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_blocks": 3}))
    with pytest.raises(WeightsError, match=r"config\.json: unknown config keys \['num_blocks'\]"):
        Flux2Transformer.from_pretrained(folder)


def test_error_config_bad_value(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "axes_dims_rope": [4, 4, 4, 2]}))
    with pytest.raises(WeightsError, match=r"config\.json: axes_dims_rope \[4, 4, 4, 2\] must sum to"):
        Flux2Transformer.from_pretrained(folder)


def test_error_no_safetensors(folder: Path) -> None:
    (folder / INDEX_NAME).unlink()
    with pytest.raises(WeightsError, match=f"no safetensors weights in .*expected {WEIGHTS_NAME}"):
        Flux2Transformer.from_pretrained(folder)


def test_error_index_names_missing_shard(folder: Path) -> None:
    shard = first_shard(folder)
    shard.unlink()
    with pytest.raises(WeightsError, match=rf"index\.json names shard files missing .*{shard.name}"):
        Flux2Transformer.from_pretrained(folder)


def test_error_missing_keys(folder: Path) -> None:
    rewrite_first_shard(folder, lambda tensors: tensors.pop("x_embedder.weight"))
    with pytest.raises(WeightsError, match=r"1 missing keys in the \d+ shards in .*: x_embedder\.weight$"):
        Flux2Transformer.from_pretrained(folder)


def test_error_many_missing_keys_are_truncated(tmp_path: Path) -> None:
    Flux2Transformer.random(TINY).save_pretrained(tmp_path)
    config = dataclasses.replace(TINY, num_single_layers=8)
    (tmp_path / "config.json").write_text(json.dumps(config.to_diffusers()))
    message = r"24 missing keys in .*safetensors: single.* \.\.\. and 14 more \(24 in all\)$"
    with pytest.raises(WeightsError, match=message):
        Flux2Transformer.from_pretrained(tmp_path)


def test_error_unexpected_keys(folder: Path) -> None:
    rewrite_first_shard(folder, lambda tensors: tensors.update({"lora.weight": torch.zeros(2)}))
    with pytest.raises(WeightsError, match=r"1 unexpected keys in .*: lora\.weight$"):
        Flux2Transformer.from_pretrained(folder)


def test_error_misshaped_key(folder: Path) -> None:
    rewrite_first_shard(folder, lambda tensors: tensors.update({"x_embedder.weight": torch.zeros(64, 16)}))
    with pytest.raises(
        WeightsError, match=r"x_embedder\.weight in .*safetensors \(expected \[64, 32\], found \[64, 16\]\)"
    ):
        Flux2Transformer.from_pretrained(folder)


def test_error_duplicate_key(folder: Path) -> None:
    duplicate = torch.zeros(TINY.inner_dim, TINY.in_channels)
    index = json.loads((folder / INDEX_NAME).read_text())
    last = folder / sorted(set(index["weight_map"].values()))[-1]
    save_file({**load_file(last), "x_embedder.weight": duplicate}, last)
    with pytest.raises(WeightsError, match=r"key x_embedder\.weight is stored twice"):
        Flux2Transformer.from_pretrained(folder)


def test_error_truncated_shard(folder: Path) -> None:
    shard = first_shard(folder)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(WeightsError, match=rf"{shard.name} is not a readable safetensors file"):
        Flux2Transformer.from_pretrained(folder)
