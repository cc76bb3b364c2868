"""Edge attribution patching (EAP, Syed et al. 2023; EAP-IG, Hanna et al. 2024) over the graph of a model's heads,
checked by exact single-edge path patching, and a circuit's faithfulness measured by forwards.

**The graph.** The residual stream is a sum of writes, so every reader of the stream (a *receiver*) reads each
earlier writer (a *sender*) along its own edge. Nodes:

- ``"embed"``: a sender, the token embeddings (block 0's ``hook_resid_pre``);
- ``"L{l}.H{h}"``: query head h of layer l; as a sender its write z_h W_O,h (Gemma 2/3: through the post-attention
  norm, below), as a receiver its query input (the
  stream that reaches q_h through the layer's input norm, W_Q,h and RoPE: this head only);
- ``"L{l}.KV{g}.k"``, ``"L{l}.KV{g}.v"``: KV head g of layer l as a receiver by its key / value input. A KV head is
  shared by the h / g query heads of its group (GQA, MQA), so it is one receiver, not h / g repeated ones;
- ``"L{l}.MLP"``: a sender by its output (``hook_mlp_out``), a receiver by its input (the stream into its norm);
- ``"logits"``: a receiver, the final stream (into the final norm and the unembedding).

A sender feeds every receiver after it: the embeddings and the layers below feed layer l's heads, KV heads and (with
layer l's heads) its MLP; everything feeds the logits.

**Scores.** An edge's score estimates the change of the metric (batch mean) when the sender's corrupted write
replaces its clean write along that edge only, everything else clean: ``corrupted - clean``. EAP takes it to first
order at the clean run, ``sum over positions of (w_u(corrupted) - w_u(clean)) . dm/dx_r(clean)``, where dm/dx_r is
the gradient of the metric with respect to the receiver's *own* input: for a query head, the gradient at its q
pulled back through RoPE, W_Q,h and the input norm (one batched vector-Jacobian product per layer, over its heads:
``is_grads_batched``); for a KV head the same from its k or v; for an MLP through the MLP alone; for the logits the
gradient at the final stream. One forward and one backward on the clean prompt, the heads' pattern never made (the
attention runs in its fused kernel, SDPA).

EAP-IG (Hanna et al.) averages that gradient over ``steps`` runs whose *input embeddings* are interpolated between
the corrupted and the clean ones (``e_clean - (1 - k / steps) (e_clean - e_corrupted)``, k = 1 .. steps), as Hanna
et al. interpolate the inputs. Their code takes k = 0 .. steps - 1 (from the corrupted end); we take k = 1 .. steps
so that ``steps=1`` is EAP exactly; both are Riemann sums of the same integral.

The sum of one sender's scores over all its receivers is that sender's attribution patching estimate (the gradient
of the metric at its write is the sum of the gradients at its readers' inputs; tested against
:func:`multihead.heads.patching.attribution_patching`).

**Exact checks** (:func:`check_edges`): the clean prompt with one edge's receiver given its clean input plus the
sender's change of write ``w_u(corrupted) - w_u(clean)``, everything downstream running freely: exact, by forwards,
nothing linearised. The receiver's new input is computed in an extra copy of the batch (its q, k, v or MLP output
taken from that copy), so one forward checks many edges.

**Faithfulness** (:func:`faithfulness`): every edge outside the circuit carries the sender's corrupted write (or its
mean over the corrupted batch, ``ablation="mean"``) into its receiver, every edge inside it the sender's write in
this very run: receiver r reads ``sum_(u in circuit) w_u + sum_(u outside) w_u(corrupted)``. With every edge the run
is the clean one; with none the corrupted one (corrupt ablation). ``kept = (m(circuit) - m(corrupted)) /
(m(clean) - m(corrupted))``. One forward: each receiver that reads some ablated and some kept edges reads its own
stream in its own copy of the batch (at most h + 2g + 1 copies: one layer's receivers); one that reads only ablated
edges takes the corrupted run's q, k, v, MLP output or final stream (so the empty circuit is the corrupted run).
A circuit is only as good as its paths from ``embed``: the top n edges by |score| alone can keep nothing when none
of their senders is fed by kept edges (seen on SmolLM2: EAP's top 10 keep 0.0).

The metric maps logits (rows, s, vocab) to one value per row; the exact forwards repeat the batch, so it must take
any multiple of b rows (row r belongs to pair r % b), as :func:`multihead.heads.patching.logit_difference` does.

Models: those :func:`multihead.heads.attribution.read_model` reads (our Llama port, transformers models of the
families of :data:`multihead.hf.LAYOUTS` after ``hf.enable``). Run them in eval mode (dropout off). Gemma 2/3 add a
norm between each attention and the stream: the layer writes sum_h z_h W_O,h (1 + w) / rms(a), a = sum_h z_h W_O,h,
so a head's write is z_h W_O,h (1 + w) / rms(a) with the scale of the run it is taken from (the writes of a run sum
to what its layer adds, exactly); an edge's exact check gives the receiver the sender's change of that write. A
sender's scores then do not sum to attribution patching's estimate at its z (which also moves rms(a), the other
heads' scale): the scores are held against the exact checks instead (tests/test_family_tools.py).
Not BERT: its blocks normalise after the residual sum
(post-norm), so its stream is not a sum of the writes, and it has no unembedding.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.errors import MultiheadError
from multihead.heads.attribution import hook_point, read_model, recording
from multihead.heads.patching import Metric
from multihead.layers.hooks import HookPoint

METHODS = ("eap", "eap-ig")
ABLATIONS = ("corrupt", "mean")
_CHUNK = 32  # rows per forward in the exact checks (each edge takes two copies of the batch)


@dataclass(frozen=True)
class Edge:
    """One edge of the graph; ``score``: the estimated (or measured) change of the metric, corrupted - clean."""

    sender: str
    receiver: str
    score: float


@dataclass
class EdgeScores:
    """Every edge of the graph with its score, sorted by |score|, largest first; ``steps`` the gradient points
    (1 for EAP); ``seconds`` the time it took."""

    edges: list[Edge]
    method: str
    steps: int
    clean_metric: float
    corrupted_metric: float
    n_layers: int
    n_heads: int
    n_kv_heads: int
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)

    def top(self, n: int) -> list[Edge]:
        """The n edges of largest |score|."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise MultiheadError(f"n ({n!r}) must be a non-negative int")
        return self.edges[:n]

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "steps": self.steps, "clean_metric": self.clean_metric,
                "corrupted_metric": self.corrupted_metric, "n_layers": self.n_layers, "n_heads": self.n_heads,
                "n_kv_heads": self.n_kv_heads, "seconds": self.seconds, "notes": list(self.notes),
                "edges": [{"sender": e.sender, "receiver": e.receiver, "score": e.score} for e in self.edges]}


@dataclass
class Faithfulness:
    """The fraction of the clean-minus-corrupted metric a circuit keeps when everything outside it is ablated."""

    kept: float
    circuit_metric: float
    clean_metric: float
    corrupted_metric: float
    n_edges: int
    ablation: str


# ---------------------------------------------------------------------------------------------- the graph
@dataclass(frozen=True)
class _Graph:
    n_layers: int
    n_heads: int
    n_kv_heads: int
    senders: tuple[str, ...]
    receivers: tuple[str, ...]
    sender_stage: tuple[int, ...]  # embed 0, layer l's heads 2l + 1, its MLP 2l + 2
    receiver_stage: tuple[int, ...]  # layer l's q/k/v 2l + 1, its MLP 2l + 2, logits 2L + 1

    @property
    def sender_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.senders)}

    @property
    def receiver_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.receivers)}

    def mask(self) -> Tensor:
        """(n_senders, n_receivers) bool: which pairs are edges."""
        return torch.tensor(self.sender_stage)[:, None] < torch.tensor(self.receiver_stage)[None, :]

    def describe(self) -> str:
        return (f"{self.n_layers} layers of {self.n_heads} query heads and {self.n_kv_heads} KV heads: senders "
                f"'embed', 'L{{l}}.H{{h}}', 'L{{l}}.MLP'; receivers 'L{{l}}.H{{h}}', 'L{{l}}.KV{{g}}.k', "
                f"'L{{l}}.KV{{g}}.v', 'L{{l}}.MLP', 'logits' (l < {self.n_layers}, h < {self.n_heads}, "
                f"g < {self.n_kv_heads})")

    def first_receiver(self, layer: int) -> int:
        """Index of layer ``layer``'s first receiver (its query heads, then k, v per KV head, then its MLP)."""
        return layer * (self.n_heads + 2 * self.n_kv_heads + 1)

    def first_sender(self, layer: int) -> int:
        return 1 + layer * (self.n_heads + 1)


def _graph(n_layers: int, h: int, g: int) -> _Graph:
    senders, s_stage = ["embed"], [0]
    receivers, r_stage = [], []
    for layer in range(n_layers):
        senders += [f"L{layer}.H{i}" for i in range(h)] + [f"L{layer}.MLP"]
        s_stage += [2 * layer + 1] * h + [2 * layer + 2]
        receivers += ([f"L{layer}.H{i}" for i in range(h)] + [f"L{layer}.KV{j}.k" for j in range(g)]
                      + [f"L{layer}.KV{j}.v" for j in range(g)] + [f"L{layer}.MLP"])
        r_stage += [2 * layer + 1] * (h + 2 * g) + [2 * layer + 2]
    receivers.append("logits")
    r_stage.append(2 * n_layers + 1)
    return _Graph(n_layers, h, g, tuple(senders), tuple(receivers), tuple(s_stage), tuple(r_stage))


# ---------------------------------------------------------------------------------------------- reading the model
@dataclass(frozen=True)
class _Net:
    m: Any  # multihead.heads.attribution's reading of the model
    pre: tuple[HookPoint, ...]  # each block's hook_resid_pre
    mid: tuple[HookPoint, ...]  # each block's hook_resid_mid
    mlp: tuple[Callable[[Tensor], Tensor], ...]  # each block's MLP as a function of the stream (norm included)
    graph: _Graph


def _blocks(model: Any) -> tuple[list[nn.Module], tuple[str, str, str]]:
    """The decoder blocks, and the names of (the norm a transformers block's MLP reads the stream through, the MLP,
    the module whose output the block adds: the MLP, or Gemma 2/3's post-feed-forward norm)."""
    from multihead import hf
    from multihead.heads.adapters import DecoderHeads, TransformersHeads
    from multihead.models.decoder import Decoder
    from multihead.models.llama import LlamaModel

    inner = model.model if isinstance(model, DecoderHeads | TransformersHeads | Decoder) else model
    if isinstance(inner, LlamaModel):
        return list(inner.layers), ("ffn_norm", "", "")
    layout = hf.block_layout(inner)
    return list(hf.decoder_layers(inner).values()), (layout.mlp_norm, layout.mlp, layout.mlp_write)


def _mlp_fn(block: Any, names: tuple[str, str, str]) -> Callable[[Tensor], Tensor]:
    if all(hasattr(block, p) for p in ("ffn_norm", "gate_proj", "up_proj", "down_proj")):  # our Llama port
        def port(x: Tensor) -> Tensor:
            n = block.ffn_norm(x)
            out: Tensor = block.down_proj(F.silu(block.gate_proj(n)) * block.up_proj(n))
            return out
        return port

    norm, mlp, write = names

    def transformers(x: Tensor) -> Tensor:
        out = getattr(block, mlp)(getattr(block, norm)(x))
        y: Tensor = out[0] if isinstance(out, tuple) else out  # gpt-oss's experts return (output, router scores)
        if write != mlp:  # Gemma 2/3: the post-feed-forward norm before the stream
            y = getattr(block, write)(y)
        return y
    return transformers


def check_model(model: Any) -> Any:
    """The model as edge attribution reads it (:func:`multihead.heads.attribution.read_model`), or a
    MultiheadError saying why it cannot."""
    return read_model(model)


def _net(model: Any) -> _Net:
    m = check_model(model)
    blocks, mlp_names = _blocks(model)
    if len(blocks) != len(m.layers):
        raise MultiheadError(f"{m.name}: {len(blocks)} decoder blocks for {len(m.layers)} attention layers")
    heads = {(layer.n_heads, layer.n_kv_heads) for layer in m.layers}
    if len(heads) != 1:
        raise MultiheadError(f"{m.name}'s layers have different head counts {sorted(heads)} (a pruned model): "
                             "edge attribution needs equal layers")
    (h, g), = heads
    pre = tuple(hook_point(b, "hook_resid_pre", f"block {i}") for i, b in enumerate(blocks))
    mid = tuple(hook_point(b, "hook_resid_mid", f"block {i}") for i, b in enumerate(blocks))
    return _Net(m, pre, mid, tuple(_mlp_fn(b, mlp_names) for b in blocks), _graph(len(m.layers), h, g))


def _check_ids(clean: Any, corrupted: Any) -> None:
    ok = [isinstance(t, Tensor) and t.ndim == 2 and t.dtype in (torch.long, torch.int32) for t in (clean, corrupted)]
    if not all(ok):
        shapes = [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in (clean, corrupted)]
        raise MultiheadError(f"clean and corrupted must be integer token id tensors (b, s), got {shapes[0]} and "
                             f"{shapes[1]}")
    if clean.shape != corrupted.shape:
        raise MultiheadError(f"the clean ids {tuple(clean.shape)} and the corrupted ids {tuple(corrupted.shape)} "
                             "must have the same shape: edges are patched position by position")


def _rows(metric: Metric, logits: Tensor, b: int) -> Tensor:
    rows = metric(logits)
    if not isinstance(rows, Tensor) or rows.shape != (b,):
        got = tuple(rows.shape) if isinstance(rows, Tensor) else type(rows).__name__
        raise MultiheadError(f"the metric must give one value per row ({b},), got {got}")
    return rows


def _head_writes(layer: Any, z: Tensor, a: Tensor | None = None) -> Tensor:
    """z (b, h, s, d) -> each head's write z_h W_O,h (b, h, s, D); through a post-attention norm (Gemma 2/3) with
    its scale from the attention's output ``a`` (b, s, D) of the same run: z_h W_O,h (1 + w) / rms(a)."""
    h, d = layer.n_heads, layer.head_dim
    out = torch.einsum("bhsd,Dhd->bhsD", z, layer.w_o.to(z.dtype).view(-1, h, d))
    if layer.post is None:
        return out
    if a is None:
        raise MultiheadError("a head's write through a post-attention norm needs the attention's output")
    scaled: Tensor = out * layer.post.gamma.to(z.dtype) * layer.post.inverse_scale(a)[:, None, :, None]
    return scaled


def _writes(net: _Net, ids: Tensor) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    """One run: logits, every sender's write [(b, s, D)] in sender order, and what was seen (q, k, v, mlp, final)."""
    m = net.m
    points = {"embed": m.embed, "final": m.layers[-1].resid_post}
    for i, layer in enumerate(m.layers):
        points |= {f"z{i}": layer.z, f"mlp{i}": layer.mlp_out, f"q{i}": layer.attn.hook_q,
                   f"k{i}": layer.attn.hook_k, f"v{i}": layer.attn.hook_v}
        if layer.post is not None:
            points[f"attn{i}"] = layer.post.out
    seen: dict[str, Tensor] = {}
    with torch.no_grad(), recording(points, seen):
        logits = m.forward(ids)
    writes = [seen["embed"]]
    for i, layer in enumerate(m.layers):
        writes += [*_head_writes(layer, seen[f"z{i}"], seen.get(f"attn{i}")).unbind(1), seen[f"mlp{i}"]]
    return logits, writes, seen


# ---------------------------------------------------------------------------------------------- EAP
def _receiver_grads(net: _Net, ids: Tensor, metric: Metric, embed: Tensor) -> Tensor:
    """(n_receivers, b, s, D): the gradient of the batch-mean metric at each receiver's own input, in a run of
    ``ids`` whose embeddings are replaced by ``embed``."""
    m, g = net.m, net.graph
    b = ids.shape[0]
    leaf = embed.detach().clone().requires_grad_(True)

    def put(x: Tensor, _p: HookPoint) -> Tensor:
        return leaf.to(x.dtype)

    points: dict[str, HookPoint] = {"final": m.layers[-1].resid_post}
    for i, layer in enumerate(m.layers):
        points |= {f"pre{i}": net.pre[i], f"mid{i}": net.mid[i], f"q{i}": layer.attn.hook_q,
                   f"k{i}": layer.attn.hook_k, f"v{i}": layer.attn.hook_v, f"mlp{i}": layer.mlp_out}
    seen: dict[str, Tensor] = {}
    with torch.enable_grad():
        with recording(points, seen, [(m.embed, put)], detach=False):
            logits = m.forward(ids)
        total = _rows(metric, logits, b).sum() / b
        keys = [f"{p}{i}" for i in range(g.n_layers) for p in ("q", "k", "v", "mlp")] + ["final"]
        if not total.requires_grad:
            raise MultiheadError("the metric does not depend on the logits' graph: give a differentiable metric "
                                 "(e.g. logit_difference(answers, wrongs))")
        grads = torch.autograd.grad(total, [seen[k] for k in keys], retain_graph=True, allow_unused=True)
        grad = dict(zip(keys, grads, strict=True))
        out: list[Tensor] = []
        for i in range(g.n_layers):
            x = seen[f"pre{i}"]
            ys = [seen[f"{p}{i}"] for p in ("q", "k", "v")]
            widths = [y.shape[1] for y in ys]
            n = sum(widths)  # this layer's attention receivers: h query heads, g keys, g values
            cotangents, offset = [], 0
            for y, width, p in zip(ys, widths, ("q", "k", "v"), strict=True):
                gy = grad[f"{p}{i}"]
                one = torch.zeros(n, *y.shape, dtype=y.dtype, device=y.device)  # (n, b, heads, s, d)
                if gy is not None:
                    rows = torch.arange(width, device=y.device)
                    one[offset + rows, :, rows] = gy.transpose(0, 1)
                cotangents.append(one)
                offset += width
            (gx,) = torch.autograd.grad(ys, x, cotangents, retain_graph=True, is_grads_batched=True,
                                        allow_unused=True)
            if gx is None:
                raise MultiheadError(f"layer {i}'s q, k and v do not depend on the stream its block reads: an "
                                     "architecture edge attribution does not read")
            out += list(gx.unbind(0))  # (b, s, D) per receiver, in receiver order
            gm = grad[f"mlp{i}"]
            xm = seen[f"mid{i}"].detach().requires_grad_(True)
            if gm is None:
                out.append(torch.zeros_like(xm))
            else:
                y = net.mlp[i](xm)
                _same_mlp(y, seen[f"mlp{i}"], i)
                (gx,) = torch.autograd.grad(y, xm, gm)
                out.append(gx)
        gf = grad["final"]
        out.append(torch.zeros_like(seen["final"]) if gf is None else gf)
    return torch.stack([o.detach() for o in out])


def _same_mlp(recomputed: Tensor, seen: Tensor, layer: int) -> None:
    """The MLP run as a function of its input must give what the model's MLP gave (else its gradient is not the
    model's): a MultiheadError naming the difference."""
    scale = float(seen.detach().abs().max()) + 1.0
    tolerance = 1e-4 if seen.dtype in (torch.float32, torch.float64) else 64 * torch.finfo(seen.dtype).eps
    error = float((recomputed.detach() - seen.detach()).abs().max())
    if error > tolerance * scale:
        raise MultiheadError(f"layer {layer}'s MLP, run from its input, differs from the model's by {error:.3g}: an "
                             "MLP edge attribution does not read (it reads Llama's: norm, gate, up, down)")


def _prepare(model: Any, clean: Tensor, corrupted: Tensor, metric: Metric
             ) -> tuple[_Net, list[Tensor], list[Tensor], dict[str, Tensor], float, float]:
    """The model read, the clean and the corrupted run's writes, what the corrupted run saw, both metrics."""
    _check_ids(clean, corrupted)
    net = _net(model)
    b = clean.shape[0]
    clean_logits, clean_w, _ = _writes(net, clean)
    corrupt_logits, corrupt_w, corrupt_seen = _writes(net, corrupted)
    with torch.no_grad():
        m_clean = float(_rows(metric, clean_logits, b).mean())
        m_corrupt = float(_rows(metric, corrupt_logits, b).mean())
    return net, clean_w, corrupt_w, corrupt_seen, m_clean, m_corrupt


def edge_attribution(model: Any, clean: Tensor, corrupted: Tensor, metric: Metric, *, method: str = "eap",
                     steps: int = 5) -> EdgeScores:
    """Score every edge of the model's graph by EAP (``method="eap"``) or EAP-IG (``"eap-ig"``, ``steps``
    interpolation points); see the module. ``metric`` maps logits to one value per row (b,), differentiably."""
    import time

    start = time.perf_counter()
    if method not in METHODS:
        raise MultiheadError(f"method {method!r} is not one of {', '.join(METHODS)}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise MultiheadError(f"steps ({steps!r}) must be a positive int (the EAP-IG interpolation points)")
    net, clean_w, corrupt_w, _, m_clean, m_corrupt = _prepare(model, clean, corrupted, metric)
    g = net.graph
    points = 1 if method == "eap" else steps
    e_clean, e_corrupt = clean_w[0], corrupt_w[0]
    grads: Tensor | None = None
    for k in range(1, points + 1):
        embed = e_clean - (1 - k / points) * (e_clean - e_corrupt)
        step = _receiver_grads(net, clean, metric, embed).double()
        grads = step if grads is None else grads + step
    assert grads is not None
    grads = grads / points
    delta = torch.stack([(c.double() - w.double()) for c, w in zip(corrupt_w, clean_w, strict=True)])
    scores = delta.flatten(1) @ grads.flatten(1).T  # (n_senders, n_receivers)
    mask = g.mask()
    pairs = mask.nonzero().tolist()
    values = scores[mask].tolist()
    edges = [Edge(g.senders[u], g.receivers[r], v) for (u, r), v in zip(pairs, values, strict=True)]
    edges.sort(key=lambda e: -abs(e.score))
    notes = ("scores: first-order change of the metric (batch mean), corrupted - clean, sender's write along one "
             "edge", "EAP-IG interpolates the input embeddings (k = 1 .. steps)" if method == "eap-ig" else
             "EAP: gradient at the clean run")
    return EdgeScores(edges, method, points, m_clean, m_corrupt, g.n_layers, g.n_heads, g.n_kv_heads,
                      time.perf_counter() - start, notes)


# ---------------------------------------------------------------------------------------------- exact forwards
_NONE, _ALL, _MIXED = 0, 1, 2  # a receiver in one run: reads no ablated edge, only ablated edges, or some of each


def _status(ablated: Tensor, incoming: Tensor, corrupt: bool) -> Tensor:
    """(n_receivers,) status of each receiver for one run's ablated-edge mask (n_senders, n_receivers)."""
    some = ablated.any(0)
    status = some.long() * _MIXED
    if corrupt:
        status[some & (ablated == incoming).all(0)] = _ALL
    return status


def _patched_runs(net: _Net, clean: Tensor, metric: Metric, runs: Sequence[Tensor], ablated_w: Tensor,
                  corrupt_seen: dict[str, Tensor] | None) -> Tensor:
    """The metric rows (len(runs), b) of clean runs in which each run's ablated edges (a (n_senders, n_receivers)
    bool mask) carry ``ablated_w`` (n_senders, b, s, D) instead of the sender's write in that run. A receiver with
    some ablated edges reads its stream in an extra copy of the batch; one whose edges are all ablated (corrupt
    ablation: ``corrupt_seen`` given) takes the corrupted run's value."""
    m, g = net.m, net.graph
    n_runs, (b, s) = len(runs), clean.shape
    incoming = g.mask()
    states = torch.stack([_status(a, incoming, corrupt_seen is not None) for a in runs])  # (R, n_receivers)
    width = g.n_heads + 2 * g.n_kv_heads
    copies = 1
    for layer in range(g.n_layers):
        first = g.first_receiver(layer)
        copies = max(copies, 1 + int((states[:, first:first + width] == _MIXED).sum(1).max()))
        copies = max(copies, 1 + int((states[:, first + width] == _MIXED).max()))
    k = copies
    status: list[list[int]] = states.tolist()
    cur: list[Tensor] = []  # each sender's write in copy 0 of each run (R, b, s, D), in sender order

    def view(x: Tensor) -> Tensor:
        return x.view(n_runs, k, b, *x.shape[1:])

    def ablated_sum(run: int, receivers: list[int], x0: Tensor) -> Tensor:
        """(len(receivers), b, s, D): x0 + sum over each receiver's ablated senders of (ablated - current)."""
        chosen = runs[run][:len(cur), receivers]  # (u, n): the senders written so far, ablated into each receiver
        senders = chosen.any(1).nonzero()[:, 0].tolist()
        diff = ablated_w[senders].to(x0.dtype) - torch.stack([cur[u][run] for u in senders])  # (u', b, s, D)
        return x0[None] + torch.einsum("un,ubsD->nbsD", chosen[senders].to(x0.dtype), diff)

    def on_pre(layer: int) -> Callable[[Tensor, HookPoint], Tensor]:
        first = g.first_receiver(layer)

        def fn(x: Tensor, _p: HookPoint) -> Tensor:
            out = view(x).clone()
            if layer == 0:
                cur.append(out[:, 0].clone())
            for run in range(n_runs):
                mixed = [first + j for j in range(width) if status[run][first + j] == _MIXED]
                if mixed:
                    out[run, 1:1 + len(mixed)] = ablated_sum(run, mixed, out[run, 0])
            return out.view(x.shape)
        return fn

    def on_qkv(layer: int, p: str) -> Callable[[Tensor, HookPoint], Tensor]:
        first = g.first_receiver(layer)
        offset = {"q": 0, "k": g.n_heads, "v": g.n_heads + g.n_kv_heads}[p]

        def fn(x: Tensor, _p: HookPoint) -> Tensor:
            out = view(x).clone()
            for run in range(n_runs):
                mixed = [j for j in range(width) if status[run][first + j] == _MIXED]
                for j in range(x.shape[1]):
                    state = status[run][first + offset + j]
                    if state == _MIXED:
                        out[run, 0, :, j] = out[run, 1 + mixed.index(offset + j), :, j]
                    elif state == _ALL:
                        assert corrupt_seen is not None
                        out[run, 0, :, j] = corrupt_seen[f"{p}{layer}"][:, j].to(x.dtype)
            return out.view(x.shape)
        return fn

    held: dict[int, Tensor] = {}  # a post-norm layer's z (copy 0), until its attention's output is seen

    def on_z(layer: int) -> Callable[[Tensor, HookPoint], None]:
        def fn(x: Tensor, _p: HookPoint) -> None:
            z = view(x)[:, 0].reshape(n_runs * b, *x.shape[1:])
            if m.layers[layer].post is not None:
                held[layer] = z
                return
            writes = _head_writes(m.layers[layer], z).view(n_runs, b, x.shape[1], s, -1)
            cur.extend(writes.unbind(2))
        return fn

    def on_out(layer: int) -> Callable[[Tensor, HookPoint], None]:
        def fn(x: Tensor, _p: HookPoint) -> None:
            z = held.pop(layer)
            a = view(x)[:, 0].reshape(n_runs * b, *x.shape[1:])
            writes = _head_writes(m.layers[layer], z, a).view(n_runs, b, z.shape[1], s, -1)
            cur.extend(writes.unbind(2))
        return fn

    def on_mid(layer: int) -> Callable[[Tensor, HookPoint], Tensor]:
        r = g.first_receiver(layer) + width

        def fn(x: Tensor, _p: HookPoint) -> Tensor:
            out = view(x).clone()
            for run in range(n_runs):
                if status[run][r] == _MIXED:
                    out[run, 1] = ablated_sum(run, [r], out[run, 0])[0]
            return out.view(x.shape)
        return fn

    def settle(out: Tensor, r: int, key: str, mixed: Callable[[int], Tensor]) -> None:
        """Copy 0 of each run at receiver r: ``mixed(run)`` where it reads some ablated edges, the corrupted run's
        ``key`` where it reads only ablated ones."""
        for run in range(n_runs):
            if status[run][r] == _MIXED:
                out[run, 0] = mixed(run)
            elif status[run][r] == _ALL:
                assert corrupt_seen is not None
                out[run, 0] = corrupt_seen[key].to(out.dtype)

    def on_mlp(layer: int) -> Callable[[Tensor, HookPoint], Tensor]:
        r = g.first_receiver(layer) + width

        def fn(x: Tensor, _p: HookPoint) -> Tensor:
            out = view(x).clone()
            settle(out, r, f"mlp{layer}", lambda run: out[run, 1])
            cur.append(out[:, 0].clone())
            return out.view(x.shape)
        return fn

    def on_final(x: Tensor, _p: HookPoint) -> Tensor:
        out = view(x).clone()
        r = len(g.receivers) - 1
        settle(out, r, "final", lambda run: ablated_sum(run, [r], out[run, 0])[0])
        return out.view(x.shape)

    edits: list[tuple[HookPoint, Callable[..., Any]]] = []
    for i, layer in enumerate(m.layers):
        edits += [(net.pre[i], on_pre(i)), (layer.attn.hook_q, on_qkv(i, "q")), (layer.attn.hook_k, on_qkv(i, "k")),
                  (layer.attn.hook_v, on_qkv(i, "v")), (layer.z, on_z(i)), (net.mid[i], on_mid(i)),
                  (layer.mlp_out, on_mlp(i))]
        if layer.post is not None:
            edits.append((layer.post.out, on_out(i)))
    edits.append((m.layers[-1].resid_post, on_final))
    seen: dict[str, Tensor] = {}
    with torch.no_grad(), recording({"final": m.layers[-1].resid_post}, seen, edits):
        logits = m.forward(clean.repeat(n_runs * k, 1))
    main = logits.view(n_runs, k, b, *logits.shape[1:])[:, 0].reshape(n_runs * b, *logits.shape[1:])
    rows = metric(main)
    if not isinstance(rows, Tensor) or rows.shape != (n_runs * b,):
        raise MultiheadError(f"the metric must give one value per row ({n_runs * b},), got "
                             f"{tuple(rows.shape) if isinstance(rows, Tensor) else type(rows).__name__}")
    return rows.detach().view(n_runs, b)


_NODE = re.compile(r"^(embed|logits|L(\d+)\.(H(\d+)|MLP|KV(\d+)\.[kv]))$")


def _edge_mask(g: _Graph, edges: Sequence[Any]) -> list[tuple[int, int]]:
    """Each edge as (sender index, receiver index) of the graph, or a MultiheadError naming it."""
    senders, receivers, mask = g.sender_index, g.receiver_index, g.mask()
    out = []
    for e in edges:
        if not isinstance(e, Edge):
            raise MultiheadError(f"edges must be Edge objects (from edge_attribution), got {type(e).__name__}")
        u, r = senders.get(e.sender), receivers.get(e.receiver)
        if u is None or r is None:
            bad = e.sender if u is None else e.receiver
            role = "sender" if u is None else "receiver"
            hint = "a name of another model's graph" if _NODE.match(bad) else "not a node name"
            raise MultiheadError(f"edge {e.sender} -> {e.receiver}: {role} {bad!r} is {hint}; this model has "
                                 f"{g.describe()}")
        if not bool(mask[u, r]):
            raise MultiheadError(f"edge {e.sender} -> {e.receiver} is not an edge: the sender must write before the "
                                 "receiver reads (an earlier layer, or a head into its own layer's MLP)")
        out.append((u, r))
    return out


def check_edges(model: Any, clean: Tensor, corrupted: Tensor, metric: Metric, edges: Sequence[Edge]
                ) -> list[tuple[Edge, float]]:
    """Exact path patching of each edge on its own: the clean run with the sender's corrupted write along that one
    edge (the receiver reads its clean input + w_u(corrupted) - w_u(clean)), everything downstream free; each
    edge with the measured change of the metric (batch mean, patched - clean), to set beside its EAP score."""
    net, _, corrupt_w, corrupt_seen, m_clean, _ = _prepare(model, clean, corrupted, metric)
    g = net.graph
    pairs = _edge_mask(g, edges)
    ablated_w = torch.stack(corrupt_w)
    out: list[tuple[Edge, float]] = []
    per_forward = max(1, _CHUNK // (2 * clean.shape[0]))
    for start in range(0, len(pairs), per_forward):
        runs = []
        for u, r in pairs[start:start + per_forward]:
            mask = torch.zeros(len(g.senders), len(g.receivers), dtype=torch.bool)
            mask[u, r] = True
            runs.append(mask)
        rows = _patched_runs(net, clean, metric, runs, ablated_w, corrupt_seen)
        out += [(edges[start + j], float(rows[j].mean()) - m_clean) for j in range(len(runs))]
    return out


def faithfulness(model: Any, clean: Tensor, corrupted: Tensor, metric: Metric, edges: Sequence[Edge], *,
                 ablation: str = "corrupt") -> Faithfulness:
    """The metric with only ``edges`` (the circuit) carrying the run's own writes and every other edge the sender's
    corrupted write (``ablation="corrupt"``) or its mean over the corrupted batch (``"mean"``); see the module."""
    if ablation not in ABLATIONS:
        raise MultiheadError(f"ablation {ablation!r} is not one of {', '.join(ABLATIONS)}")
    net, _, corrupt_w, corrupt_seen, m_clean, m_corrupt = _prepare(model, clean, corrupted, metric)
    g = net.graph
    ablated = g.mask().clone()
    for u, r in _edge_mask(g, edges):
        ablated[u, r] = False
    ablated_w = torch.stack(corrupt_w)
    if ablation == "mean":
        ablated_w = ablated_w.mean(1, keepdim=True).expand_as(ablated_w)
    rows = _patched_runs(net, clean, metric, [ablated], ablated_w, corrupt_seen if ablation == "corrupt" else None)
    value = float(rows.mean())
    span = m_clean - m_corrupt
    if span == 0:
        raise MultiheadError(f"the metric is {m_clean:.6g} on both prompts: no fraction of it to keep")
    return Faithfulness((value - m_corrupt) / span, value, m_clean, m_corrupt,
                        len({(e.sender, e.receiver) for e in edges}), ablation)
