"""`colossalai.builder`: the pipeline tutorial's `build_pipeline_model` (pipeline/partition.py)."""
from .pipeline import build_pipeline_model

__all__ = ["build_pipeline_model"]
