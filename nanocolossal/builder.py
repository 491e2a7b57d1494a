"""`colossalai.builder`: the pipeline tutorial imports `build_pipeline_model` from here (see
pipeline/partition.py)."""
from .pipeline import build_pipeline_model

__all__ = ["build_pipeline_model"]
