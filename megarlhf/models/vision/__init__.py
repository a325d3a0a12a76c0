"""Vision encoders for vision-language policies (issue 66), kept apart from the megatron GPT stack.

A vision tower turns the image processor's flattened patches into one embedding per merged
token, which the language model later splices in at its image placeholder tokens; `mrope`
gives those tokens the 3D (temporal, height, width) rotary positions the language model
expects. The towers are plain torch modules, small next to the language model, so every
tensor-parallel rank holds a full replica and no megatron layer is involved. Parameter names
match the HF checkpoints' `visual.*` tensors so loading is a rename-free copy.
"""
