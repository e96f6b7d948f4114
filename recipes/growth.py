"""Function-preserving depth growth ("block expansion", LLaMA Pro, Wu et al. 2024, arXiv 2401.02415 §2.2).

A deeper model is built from a trained one by inserting, after original layers, copies whose output projections
(`self_attn.o_proj` and `mlp.down_proj`) are zero: each inserted layer adds nothing to the residual stream, so the
grown model computes exactly the original's logits before training; training then uses the new depth. The recipe
grows the bundled SDAR model into its larger SimSD target (`--grow-layers`).
"""

from __future__ import annotations

import copy

import torch


def expansion_plan(old_layers: int, new_layers: int) -> list[tuple[int, bool]]:
    """For each layer of the grown model, `(source layer index, is_copy)`; copies follow their source evenly.

    Raises:
        ValueError: `new_layers` is not a multiple of `old_layers` or is smaller.
    """
    if new_layers < old_layers or new_layers % old_layers:
        raise ValueError(f"--grow-layers={new_layers} must be a multiple of the model's {old_layers} layers; pass e.g. "
                         f"{2 * old_layers} or {4 * old_layers}")
    per = new_layers // old_layers
    return [(i, k > 0) for i in range(old_layers) for k in range(per)]


@torch.no_grad()
def grow_depth(model, new_layers: int):
    """Grow a Qwen2/Qwen3-style decoder (`model.model.layers`) to `new_layers` layers in place; returns `model`.

    Copies take their source layer's weights with `self_attn.o_proj` and `mlp.down_proj` zeroed (the output is
    unchanged). The config's `num_hidden_layers` and `layer_types` follow; `layer_idx` is renumbered.
    """
    layers = model.model.layers
    plan = expansion_plan(len(layers), new_layers)
    grown = []
    for index, (source, is_copy) in enumerate(plan):
        layer = copy.deepcopy(layers[source]) if is_copy else layers[source]
        if is_copy:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        layer.self_attn.layer_idx = index
        grown.append(layer)
    model.model.layers = torch.nn.ModuleList(grown)
    config = model.config
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[source] for source, _ in plan]
    config.num_hidden_layers = new_layers
    return model
