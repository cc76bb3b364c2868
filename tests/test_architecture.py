"""The package's shape: its import graph has no cycle, the analyses (heads/) never import the experiments above
them (tradeoff/), and no module reaches into another module's private names.

Both read the source with ast, so every import counts: module level, inside functions, under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from pathlib import Path

import multihead

PACKAGE = Path(multihead.__file__).parent
# private names a module may use from another, with the reason (none today)
KNOWN: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["multihead", *path.relative_to(PACKAGE).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports (``from a import b`` is a.b when that is a module, else a)."""

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        out |= {r for t in targets if t.startswith("multihead") and (r := resolve(t)) is not None and r != name}
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def test_the_import_graph_has_no_cycle() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert {"multihead.layers.step", "multihead.cache.base", "multihead.config"} <= set(graph)
    assert "multihead.layers.attention" not in graph["multihead.config"]  # config describes, the layer builds
    assert "multihead.layers.attention" not in graph["multihead.layers.latent"]  # Step lives in its own module
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _upward(graph: dict[str, set[str]], low: str, high: str) -> list[str]:
    """``module -> import`` for each import from a module of the package ``low`` into the package ``high``."""
    return sorted(f"{name} -> {dep}" for name, deps in graph.items() if _within(name, low)
                  for dep in deps if _within(dep, high))


def test_the_analyses_never_import_the_experiments_that_use_them() -> None:
    """heads/ (the analyses) sits below tradeoff/ (the experiments that use them: importance, pooling), never both
    ways; the needle cases and the answer reading both stand on (evals/) import neither."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "multihead.tradeoff.prune" in graph and "multihead.heads.retrieval" in graph
    assert "multihead.heads.patching" in graph["multihead.tradeoff.prune"]  # the allowed direction is in use
    assert _upward(graph, "multihead.heads", "multihead.tradeoff") == []
    assert _upward(graph, "multihead.evals", "multihead.heads") == []
    assert _upward(graph, "multihead.evals", "multihead.tradeoff") == []


# the package's rooms, bottom to top: a room imports only rooms of its own rank or below
RANKS = {"core": 0, "models": 1, "hf": 1, "evals": 2, "heads": 3, "tradeoff": 4, "experiments": 5, "cli": 6}
# modules of an upper room that the core reads, with the reason
CORE_READERS = {"multihead.hf.config": "the one reader of a config.json: it imports no transformers, and sizing, "
                                       "head plans and the CPU rules read a model's numbers with it"}
TOP = {"__init__.py", "__main__.py", "py.typed", "config.py", "errors.py", "divisors.py", "values.py", "names.py",
       "files.py", "quant.py", "layers", "cache", "kernels", "hf", "sizing", "verify", "models", "evals", "heads",
       "tradeoff", "experiments", "cli", "data"}


def _rank(module: str) -> int:
    if module in CORE_READERS:
        return 0
    room = module.split(".")[1] if module.count(".") else ""
    return RANKS.get(room, 0)


def _climbs(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if _rank(b) > _rank(a) and a not in ("multihead", "multihead.__main__"))


def test_the_top_level_is_the_rooms_along_the_route() -> None:
    """The package's top level is its rooms (issue 51): the layers, the cache, the kernels, the transformers
    integration, sizing and verification, the models, and the analyses above them, beside the few modules every room
    reads. A new flat module is a decision to make here, not a default."""
    found = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    assert found == TOP, (sorted(found - TOP), sorted(TOP - found))


def test_the_rooms_import_downward_only() -> None:
    """The core (config, layers, cache, kernels, sizing, verify and the shared modules) imports no model, analysis or
    command; models and the transformers integration no evaluation or analysis; the evaluations no analysis; the
    analyses (heads/) no experiment that uses them (tradeoff/, experiments/); nothing but the entry point the
    CLI."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "multihead.hf.config" in graph["multihead.sizing"]  # the one exception, in use
    assert _climbs(graph) == []
    assert _climbs({"multihead.cache.x": {"multihead.models.llama"}, "multihead.heads.y": {"multihead.cli"},
                    "multihead.sizing": {"multihead.hf.config"}}) == [
        "multihead.cache.x -> multihead.models.llama", "multihead.heads.y -> multihead.cli"]


def test_the_direction_check_sees_an_upward_import() -> None:
    graph = {"multihead.heads.a": {"multihead.tradeoff.b", "multihead.layers.hooks"},
             "multihead.headsx": {"multihead.tradeoff"}, "multihead.tradeoff.b": {"multihead.heads.a"}}
    assert _upward(graph, "multihead.heads", "multihead.tradeoff") == ["multihead.heads.a -> multihead.tradeoff.b"]


def _private_names(tree: ast.AST) -> set[str]:
    """The _names a module defines: functions, classes, assigned names and attributes, arguments, imports."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _violations(trees: dict[str, ast.AST]) -> list[str]:
    """``file:line name`` for each _name a module uses that only other modules define."""
    own = {rel: _private_names(tree) for rel, tree in trees.items()}
    everyone = set().union(*own.values())
    found = []
    for rel, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("multihead"):
                used = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                used = [] if on_self or node.attr not in everyone or node.attr in own[rel] else [node.attr]
            else:
                continue
            found += [f"{rel}:{node.lineno} {name}" for name in used if (rel, name) not in KNOWN]
    return found


def test_no_module_uses_another_modules_private_names() -> None:
    """A module may use its own _names (on self or on anything else), never one that only another module of the
    package defines: no ``from m import _x``, no ``MultiHeadAttention._positions(...)``, no ``attn._heads()``."""
    trees: dict[str, ast.AST] = {path.relative_to(PACKAGE).as_posix(): ast.parse(path.read_text(encoding="utf-8"))
                                 for path in _modules().values()}
    assert _violations(trees) == []


def test_the_private_name_check_sees_calls_across_modules() -> None:
    trees = {
        "a.py": ast.parse("class A:\n    def _heads(self):\n        return self._n\n    def f(self, o):\n"
                          "        return o._heads()\n"),
        "b.py": ast.parse("from multihead.a import _helper\ndef f(attn):\n    return attn._heads() + A._heads(attn)\n"),
        "c.py": ast.parse("def g(x):\n    return x._unknown_to_the_package\n"),
    }
    assert _violations(trees) == ["b.py:1 _helper", "b.py:3 _heads", "b.py:3 _heads"]


# ---------------------------------------------------------------------------------------------- the core's rooms
KERNELS = "multihead.kernels"  # the room: the dispatcher, each backend, the CPU decisions, their table, native/


def _kernel_module(name: str) -> bool:
    """The kernels' room and the projections' products (which read its CPU decisions)."""
    return _within(name, KERNELS) or name == "multihead.layers.linear"


def test_the_kernels_room_holds_the_decisions_the_table_and_the_native_kernels() -> None:
    """Issue 51 item 1: the CPU decisions, the tuning table, flex attention and the native kernels live inside
    multihead.kernels, not beside it at the top level."""
    modules = _modules()
    for name in ("cpu", "tuning", "flex", "native"):
        assert f"{KERNELS}.{name}" in modules and f"multihead.{name}" not in modules, name


def test_no_cache_module_imports_a_kernel_module() -> None:
    """Caches only store: no module of multihead.cache imports the dispatcher, a kernel or a speed decision."""
    modules = _modules()
    found = {name: sorted(dep for dep in _imports(name, path, modules) if _kernel_module(dep))
             for name, path in modules.items() if _within(name, "multihead.cache")}
    assert {name: kernels for name, kernels in found.items() if kernels} == {}
    assert len(found) >= 8  # the protocol, the view and every kind were looked at


# the attention kernels and the decisions that choose among them: referenced by the dispatcher alone (and defined
# where they live); tuning measures them to write the host's table, which the dispatcher then reads
KERNEL_ENTRY_POINTS = {"scaled_dot_product_attention", "flex_attention", "sdpa_attention", "math_attention",
                       "attend_dense", "attend_q4", "attend_q8", "attend_quantized", "fold_gqa_decode",
                       "native_decode_attention", "native_quantized_decode", "resolve_backend", "dense_fits"}


def _references(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in names:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute) and node.attr in names:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.ImportFrom):
            found += [(node.lineno, a.name) for a in node.names if a.name in names]
    return found


def test_no_module_outside_kernels_decides_a_backend() -> None:
    """Which kernel runs is decided in multihead.kernels alone (its tuning measures the kernels for the table): no
    other module calls an attention kernel or the decisions that choose one (they may call kernels.attend)."""
    outside = {}
    for name, path in _modules().items():
        if _within(name, KERNELS):
            continue
        refs = _references(ast.parse(path.read_text(encoding="utf-8")), KERNEL_ENTRY_POINTS)
        if refs:
            outside[name] = refs
    assert outside == {}


def test_the_entry_point_check_sees_a_call() -> None:
    tree = ast.parse("import torch.nn.functional as F\nfrom multihead.kernels.native import attend_dense\n"
                     "def f(q, k, v):\n    return F.scaled_dot_product_attention(q, k, v)\n")
    assert _references(tree, KERNEL_ENTRY_POINTS) == [(2, "attend_dense"), (4, "scaled_dot_product_attention")]


L = "multihead.layers."
STAGES = (L + "step", L + "linear", L + "rope", "multihead.cache", L + "hooks", "multihead.kernels")
DATA = {"multihead.cache.view", L + "masks", "multihead.errors", "multihead.config"}  # types, read anywhere


# the forward's route, top to bottom (W_O: the projections again), and the codes' arithmetic the caches and the
# kernels both use
ROUTE = ("multihead.layers.attention", *STAGES, "multihead.quant")


def _room(module: str) -> str:
    if module in DATA or not module.startswith("multihead"):
        return module
    for stage in ("multihead.cache", "multihead.kernels"):
        if module.startswith(stage + "."):
            return stage
    return module


def _walk(run: object) -> tuple[list[str], list[tuple[str, str]]]:
    """Run ``run()`` under a profiler: the rooms the layer's forward enters from its own frames, in order with
    repeats collapsed, and every (room, room) a call crossed between the package's stages below it."""
    import sys

    top: list[str] = []
    crossings: list[tuple[str, str]] = []

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event != "call":
            return
        callee = _room(frame.f_globals.get("__name__", ""))
        caller_frame = frame.f_back  # the nearest frame of the package's (nn.Module.__call__ and the like between)
        while caller_frame is not None and not caller_frame.f_globals.get("__name__", "").startswith("multihead"):
            caller_frame = caller_frame.f_back
        caller = _room(caller_frame.f_globals.get("__name__", "")) if caller_frame is not None else ""
        if not callee.startswith("multihead") or callee == caller or callee in DATA:
            return
        if caller == "multihead.layers.attention":
            if not top or top[-1] != callee:
                top.append(callee)
        elif caller.startswith("multihead"):
            crossings.append((caller, callee))

    sys.setprofile(profile)
    try:
        run()  # type: ignore[operator]
    finally:
        sys.setprofile(None)
    return top, crossings


def _decode_layer(kind: str):  # type: ignore[no-untyped-def]
    import torch

    from multihead import HeadPlan, HeadwiseCache, KVCache, MultiHeadAttention, QuantizedKVCache, SinkCache

    torch.manual_seed(0)
    layer = MultiHeadAttention(d_model=384, n_heads=6, n_kv_heads=2, rope=10000.0).eval()
    caches = {"full": lambda: KVCache(batch=1, n_kv_heads=2, head_dim=64, max_len=80),
              "sink": lambda: SinkCache(batch=1, n_kv_heads=2, head_dim=64, window=16, sink_tokens=2),
              "int4": lambda: QuantizedKVCache(batch=1, n_kv_heads=2, head_dim=64, max_len=80, bits=4, residual=8),
              "int8": lambda: QuantizedKVCache(batch=1, n_kv_heads=2, head_dim=64, max_len=80, bits=8, residual=8),
              "int2": lambda: QuantizedKVCache(batch=1, n_kv_heads=2, head_dim=64, max_len=80, bits=2, residual=8),
              "head-wise": lambda: HeadwiseCache(HeadPlan(full=[[True, False]], sinks=2, window=16, model="t",
                                                          shape=(1, 6, 2, 64)), batch=1, max_len=80)}
    cache = caches[kind]()
    with torch.no_grad():
        layer(torch.randn(1, 64, 384), causal=True, cache=cache.layer(0))
        cache.advance(64)
    x = torch.randn(1, 1, 384)
    step = layer.step(x, causal=True, cache=cache.layer(0))
    return lambda: layer(x, step=step, cache=cache.layer(0))


def test_a_walk_of_the_forward_visits_each_room_once_in_order() -> None:
    """The forward reads project -> rotate -> update -> attend -> merge: from the layer's own frames it enters the
    step's checks, the projections, RoPE, the cache's one verb, the hook points and the dispatcher, each once and in
    that order, then W_O; whatever the cache kind (the layer never asks which it holds). Below it, nothing climbs
    back up the route (attention, step, projections, RoPE, cache, hooks, kernels): a cache calls no kernel or
    decision, the dispatcher never enters the layer, the step or a cache (it reads the cache's view, a data type),
    and its decisions, table and native kernels are in its own room (issue 51: at most two climbs; none now)."""
    import torch

    for kind in ("full", "sink", "int4", "int8", "int2", "head-wise"):  # native codes, codes read back, groups
        with torch.no_grad():
            top, crossings = _walk(_decode_layer(kind))
        assert top == [L + "step", L + "linear", L + "rope", "multihead.cache", L + "hooks", "multihead.kernels",
                       L + "linear"], (kind, top)
        climbs = [(a, b) for a, b in crossings if ROUTE.index(b) < ROUTE.index(a)]
        assert climbs == [], (kind, sorted(set(climbs)))
        assert set(crossings) <= {("multihead.layers.linear", KERNELS), (KERNELS, "multihead.quant")}, (kind, crossings)
    from multihead import MultiHeadAttention

    layer = MultiHeadAttention(d_model=384, n_heads=6, n_kv_heads=2, rope=10000.0).eval()
    with torch.no_grad():
        top, _ = _walk(lambda: layer(torch.randn(2, 10, 384), causal=True))  # uncached: the layer makes its step
    assert top == [L + "step", L + "linear", L + "rope", L + "hooks", "multihead.kernels", L + "linear"], top


def test_module_docstrings_hold_no_dated_measurements() -> None:
    """A module's docstring says what the module is and does; measurements are tied to a host and a day and live in
    benchmarks/RESULTS.md (issue 51 item 6), where they are recorded with both. No module docstring names a date."""
    import re

    dated = re.compile(r"\b20\d\d-\d\d-\d\d\b")
    found = []
    for name, path in sorted(_modules().items()):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or ""
        found += [f"{name}: {line.strip()}" for line in doc.splitlines() if dated.search(line)]
    assert found == []


def test_the_step_and_the_kernel_call_know_no_cache_kind() -> None:
    """Issue 51 item 2: what differs by cache kind travels in the view a cache's update returns. A head-wise layer's
    groups carry their own masks (made once a step by the cache at reserve); the step holds one mask and the
    cache's slots, the kernels' call one view and one mask, and neither module reads a head-wise cache's parts or
    a list of masks. MLA's layer hands the kernels its latents as a view, and the kernels take the path."""
    import dataclasses

    from multihead.cache.view import KVGroup
    from multihead.kernels import AttentionCall
    from multihead.layers.masks import MaskSpec
    from multihead.layers.step import Step

    assert [f.name for f in dataclasses.fields(Step)] == ["mask", "positions", "rope", "slots"]
    assert "masks" not in {f.name for f in dataclasses.fields(AttentionCall)}
    assert {f.name: f.type for f in dataclasses.fields(KVGroup)}["mask"] in (MaskSpec, "MaskSpec")
    import re

    reads = re.compile(r"(?<!multihead\.layers)\.(parts|masks)\b")
    for name in ("multihead.layers.step", "multihead.kernels"):
        assert reads.findall(_modules()[name].read_text(encoding="utf-8")) == [], name
    # MLA: the layer hands the kernels a LatentKV; which path runs (and its folded decode) is decided there
    latent = _modules()["multihead.layers.latent"].read_text(encoding="utf-8")
    assert re.findall(r"einsum|rows_are_heads|MaskSpec\(|DenseKV\(", latent) == []


def test_the_transformers_room_is_one_package_whose_modules_load_when_used() -> None:
    """Issue 51 item 1: hf, hfcache and hfconfig are one package, multihead.hf, a module a concern; its public names
    (``hf.enable``, ``hf.new_cache``, ...) each resolve from the module that defines them, and reading a config.json
    (multihead.hf.config, which sizing uses) imports neither transformers nor the attention modules."""
    import importlib
    import subprocess
    import sys

    from multihead import hf

    modules = _modules()
    assert {"multihead.hf", "multihead.hf.attention", "multihead.hf.cache", "multihead.hf.config",
            "multihead.hf.switch", "multihead.hf.loader", "multihead.hf.mla"} <= set(modules)
    assert not {"multihead.hfcache", "multihead.hfconfig"} & set(modules)
    assert sorted(hf.__all__) == sorted(hf._WHERE)
    assert not set(hf._HOMES) & set(hf._WHERE)  # a submodule named like a public name would replace it once imported
    for name, module in hf._WHERE.items():
        assert getattr(hf, name) is getattr(importlib.import_module(f"multihead.hf.{module}"), name), name
    code = ("import sys, multihead.hf.config; print(sorted(m for m in sys.modules if m.startswith('transformers') or "
            "m in ('multihead.hf.attention', 'multihead.hf.switch', 'multihead.hf.cache')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_sizing_room_holds_the_arithmetic_on_configs() -> None:
    """Issue 51 item 1: the arithmetic on configs (cost, presets, compare, shapes, units, hardware) lives in
    multihead.sizing beside the whole-model sizing, not at the top level; reading a config.json (multihead.hf.config)
    loads the sizing only when it makes a layer's kind, so the two import each other without a cycle."""
    modules = _modules()
    for name in ("cost", "presets", "compare", "shapes", "units", "hardware"):
        assert f"multihead.sizing.{name}" in modules and f"multihead.{name}" not in modules, name
    top = sorted(path.name for path in PACKAGE.iterdir() if path.name != "__pycache__")
    assert len(top) <= 32, top  # 44 entries at the start of the re-housing
