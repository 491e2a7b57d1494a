"""Compatibility, apart from the ideas: Colossal-AI's and apex's names and spellings, so that the
tutorials' code runs with `colossalai` -> `nanocolossal`: colossal_1d/2d/2p5d/3d.py (its layer
classes over tensor/, re-exported by nanocolossal.nn), colossal_args.py (their constructor
arguments), apex.py (fp16 key spellings), zero_v01.py (v0.1's zero=dict(model_config, ...)).
"""
