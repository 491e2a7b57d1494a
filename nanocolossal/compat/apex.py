"""apex's and Colossal-AI's fp16 key spellings, mapped onto ours (amp_settings.py).

A config ported from Colossal-AI or apex keeps its keys: the loss scaler's names are renamed
onto DynamicLossScaler's (amp_scaler.py), and a key whose machinery does not exist here is an
error that says what to do instead, never ignored.
"""
from __future__ import annotations

RENAMED = {  # Colossal-AI / apex spelling -> ours
    "initial_scale": "init_scale",        # Colossal-AI's naive mode (and zero's optimizer_config)
    "min_loss_scale": "min_scale",        # apex
    "max_loss_scale": "max_scale",        # apex
}
NO_EFFECT = {  # keys the backends take that mean nothing here, and what to do instead
    "clip_grad_norm": "set clip_grad_norm at the top level of the config (the Engine clips the "
                      "unscaled gradients in every mode)",
    "verbose": "remove it (the scaler logs each skipped step)",
    "verbosity": "remove it (the scaler logs each skipped step)",
    "log_num_zeros_in_grad": "remove it",
    "cast_model_type": "use dtype='float16' or 'bfloat16'",
    "patch_torch_functions": "use mode=AMP_TYPE.TORCH (autocast) for O1",
    "cast_model_outputs": "remove it (the model's output is cast to float32)",
    "num_losses": "remove it (one loss, one scaler)",
}
