"""Vision encoders for vision-language policies (issue 66), kept apart from the megatron GPT stack.

A vision tower turns the image processor's flattened patches into one embedding per merged
token, which the language model later splices in at its image placeholder tokens; `mrope`
gives those tokens the 3D (temporal, height, width) rotary positions the language model
expects. The towers are plain torch modules, small next to the language model, so every
tensor-parallel rank holds a full replica and no megatron layer is involved. Parameter names
match the HF checkpoints' `visual.*` tensors so loading is a rename-free copy.
"""


def refuse_in_stages(model, where: str) -> None:
    """ValueError naming `where` if `model` is a vision-language model: it converts and
    verifies (tools/convert_hf), but no stage feeds images through its schedule or rollout
    engines yet, and a text-only step would train it on its placeholders' embeddings."""
    if model.vision is not None or model.mrope_section is not None:
        raise ValueError(f"{where} is a vision-language model (Qwen2.5-VL: M-RoPE"
                         f"{', a vision tower' if model.vision is not None else ''}): it "
                         f"converts and verifies, but training stages and rollouts with images "
                         f"are not supported yet")
