"""Which head tool takes which transformers family: one table (:data:`SUPPORT`, family x tool), built from the
tools' own readers and refusals (:data:`multihead.hf.LAYOUTS`, :data:`multihead.heads.attribution.READ_FAMILIES`
and its refusals, composition's families, edge attribution's post-norm refusal), so a refusal here is the
MultiheadError the tool raises, word for word. The README's support matrix is :func:`markdown` of it (a test holds
the two equal), and tests/test_family_tools.py runs every cell on a tiny model of the family.

A cell is ``Cell(True, note)`` where the tool runs (the note says what the family adds: a frozen norm scale, a
softcap applied) or ``Cell(False, why)`` where it refuses, with the reason."""

from __future__ import annotations

from dataclasses import dataclass

from multihead import hf
from multihead.heads import attribution, composition

# the tools, as the README names them
TOOLS = {
    "resid": "residual hook points",
    "dla": "direct logit attribution",
    "logit_lens": "logit lens",
    "head_lens": "head lens",
    "composition": "composition scores",
    "path_patching": "path patching",
    "eap": "EAP / EAP-IG",
    "circuit": "`multihead circuit`",
}
# the families (transformers model_type) and the family a default config of each has a final logit softcap in
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo", "phi3", "gpt_oss", "gemma", "gemma2",
            "gemma3_text", "gpt2")
SOFTCAPPED = ("gemma2",)  # final_logit_softcapping is set by default (30.0)


@dataclass(frozen=True)
class Cell:
    ok: bool
    why: str = ""


def _post_norm(family: str) -> bool:
    layout = hf.LAYOUTS[family]
    return layout.attn_write != layout.attention


def _cells(family: str) -> dict[str, Cell]:
    reads = family in attribution.READ_FAMILIES
    refused = attribution.REFUSED.get(family, "")
    gemma = hf.LAYOUTS[family].norm_offset != 0
    post = _post_norm(family)
    capped = family in SOFTCAPPED
    read_note = "; ".join(n for n, on in (
        ("Gemma's (1 + weight) norms", gemma),
        ("the post-attention norm's scale frozen at the real run's", post)) if on)
    cells = {"resid": Cell(family in hf.LAYOUTS, "writes after Gemma's post-norms" if post else "")}
    if not reads:
        for tool in ("dla", "logit_lens", "head_lens", "path_patching", "eap", "circuit"):
            cells[tool] = Cell(False, refused)
    else:
        before_cap = "; the logits before the final softcap" if capped else ""
        cells["dla"] = Cell(True, read_note + before_cap)
        cells["head_lens"] = Cell(True, read_note + before_cap)
        cells["logit_lens"] = Cell(True, "the softcap applied, as the model does" if capped else "")
        cells["path_patching"] = Cell(True, "the sender's write passes its layer's post-attention norm, the other "
                                            "heads frozen" if post else "")
        cells["eap"] = Cell(True, "a head's write through the post-attention norm with its run's scale" if post
                            else "")
        # a circuit is DLA, EAP and composition together
        cells["circuit"] = Cell(True)
    folds = "Gemma's (1 + weight) norms folded" + (", the post-attention norm's into W_O" if post else "")
    cells["composition"] = Cell(True, folds if gemma else "") if family in composition.HF_FAMILIES else Cell(
        False, "composition scores do not read its weights")
    for tool, note in _FAMILY_NOTES.get(family, {}).items():
        cell = cells[tool]
        cells[tool] = Cell(cell.ok, "; ".join(n for n in (cell.why, note) if n)) if cell.ok else cell
    return {tool: cells[tool] for tool in TOOLS}


# what a family adds that the readers take, beyond its layout (as the readers' notes say it)
_FAMILY_NOTES: dict[str, dict[str, str]] = {
    "olmo": {"dla": "a final LayerNorm without parameters", "head_lens": "a final LayerNorm without parameters",
             "composition": "LayerNorms without parameters: their centring folded"},
    "phi3": {"composition": "the fused qkv_proj split into W_Q, W_K, W_V by rows"},
    "gpt_oss": {"dla": "W_O's bias shared equally among the heads", "composition": "the sink logits outside the "
                "static circuit"},
}


SUPPORT: dict[str, dict[str, Cell]] = {family: _cells(family) for family in FAMILIES}


def markdown() -> str:
    """The support matrix as a Markdown table (family x tool): "yes", "yes (n)" with a note on what the family adds,
    or "no (n)" with the reason, the notes and reasons numbered under the table."""
    said: list[str] = []
    rows = ["| family | " + " | ".join(TOOLS.values()) + " |", "|---" * (len(TOOLS) + 1) + "|"]
    for family, cells in SUPPORT.items():
        shown = []
        for cell in cells.values():
            word = "yes" if cell.ok else "no"
            if not cell.why:
                shown.append(word)
                continue
            if cell.why not in said:
                said.append(cell.why)
            shown.append(f"{word} ({said.index(cell.why) + 1})")
        rows.append(f"| {family} | " + " | ".join(shown) + " |")
    return "\n".join([*rows, "", *(f"{i}. {why}" for i, why in enumerate(said, 1))]) + "\n"


__all__ = ["FAMILIES", "SUPPORT", "TOOLS", "Cell", "markdown"]
