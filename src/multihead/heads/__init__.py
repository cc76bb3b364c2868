"""What each head of a real model does: per-head attention capture, scores, labels, ablation, reports."""

from multihead.heads.adapters import HeadModel, load_head_model
from multihead.heads.capture import capture_weights
from multihead.heads.scores import SCORE_NAMES, HeadScores, label_heads, pattern_scores, repeat_scores

__all__ = [
    "SCORE_NAMES",
    "HeadModel",
    "HeadScores",
    "capture_weights",
    "label_heads",
    "load_head_model",
    "pattern_scores",
    "repeat_scores",
]
