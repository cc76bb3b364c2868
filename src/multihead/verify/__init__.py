"""How the layer is shown correct: :mod:`~multihead.verify.reference` (the float64 oracle, head by head, as the
formula reads) and :mod:`~multihead.verify.check` (the harness a user runs on their own hardware: ``multihead
check``). Nothing here runs in a model's forward."""
