"""What each head of a real model does: per-head attention capture, scores, labels, ablation, reports.

Needs the ``heads`` extra (``pip install 'multihead[heads]'``): the models' dependencies, matplotlib and tqdm.
"""

from multihead.errors import require_extra

require_extra("heads")

from multihead.heads.adapters import HeadModel, load_head_model  # noqa: E402  (after the extra's check)
from multihead.heads.capture import capture_weights  # noqa: E402  (after the extra's check)
from multihead.heads.scores import SCORE_NAMES, HeadScores, label_heads, pattern_scores, repeat_scores  # noqa: E402  (after the extra's check)

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
