"""Compatibility, apart from the ideas: Colossal-AI's and apex's names and spellings.

Nothing here is an idea of its own; each module maps another project's interface onto ours, so
that the tutorials' code runs with `colossalai` -> `nanocolossal`:

    colossal_1d.py, colossal_2d.py,  Colossal-AI's tensor-parallel layer classes (Linear1D_Col,
    colossal_2p5d.py, colossal_3d.py Linear2D, Linear2p5D, Linear3D, ...) over our layers
                                     (tensor/), with its
                                     constructor arguments (colossal_args.py); nanocolossal.nn
                                     re-exports them
    apex.py                          apex's and Colossal-AI's fp16 key spellings (amp_settings.py)
    zero_v01.py                      Colossal-AI v0.1's zero=dict(model_config, optimizer_config)

The tutorials' import paths (nanocolossal.core, utils, builder, parallel, engine.schedule,
nn.lr_scheduler, nn.metric) are one-line re-exports beside the modules they name.
"""
