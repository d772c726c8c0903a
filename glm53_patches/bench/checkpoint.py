"""``bench --model DIR``: the user's own glm5_next checkpoint, loaded as mlx-vlm loads it."""

import json
from pathlib import Path


class CheckpointError(Exception):
    """A --model folder the bench cannot use; the message is one line for the user."""


def check(folder):
    """The folder's config.json, once it looks like a glm5_next checkpoint (cheap: nothing loaded)."""
    path = Path(folder).expanduser()
    where = f"--model {folder}"
    if not path.is_dir():
        raise CheckpointError(f"{where}: no such folder")
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{where}: no config.json in it (not a model checkpoint)") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{where}: config.json is unreadable ({exc})") from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind != "glm5_next":
        raise CheckpointError(f"{where}: model_type is {kind!r}, not 'glm5_next' (GLM-5.3-Flash)")
    if not any(path.glob("*.safetensors")):  # mlx-vlm would log its own line before raising
        raise CheckpointError(f"{where}: no *.safetensors weights in it")
    return config


def load(folder):
    """The language model of a checked checkpoint folder, as mlx_vlm.load loads it."""
    from mlx_vlm.utils import load_model  # what mlx_vlm.load and mlx_vlm.server call

    try:
        model = load_model(Path(folder).expanduser(), lazy=False)
    except Exception as exc:  # noqa: BLE001 - any failure to load is the user's folder, said in one line
        first = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(f"--model {folder}: mlx-vlm could not load it ({type(exc).__name__}: {first})") from None
    return model.language_model


def describe(folder, config, model, language_config):
    """The ``model`` entry of the results for a checkpoint (its folder's name, not its path)."""
    c = language_config
    kda = c.layer_types.count("linear_attention")
    return {"preset": "checkpoint", "checkpoint": Path(folder).expanduser().resolve().name,
            "layers": c.num_hidden_layers, "kda_layers": kda, "dsa_layers": c.num_hidden_layers - kda,
            "hidden_size": c.hidden_size, "experts": c.n_routed_experts, "top_k": c.num_experts_per_tok,
            "dtype": str(model.model.norm.weight.dtype).rpartition(".")[2],
            "quantization": config.get("quantization") or config.get("quantization_config"),
            "note": "the checkpoint's own weights, loaded with mlx_vlm.utils.load_model"}
