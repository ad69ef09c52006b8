"""The shape of the code: no import cycles among workbench's modules (lazy imports included),
so each package can be read and changed from the bottom up."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "workbench"


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            mod = node.module if not node.level else (f"{base}.{node.module}" if node.module else base)
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            comp.append(v)
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    known = _modules()
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    assert "workbench.events" in graph["workbench.remote.client"]  # the finder sees real edges
    assert _cycles(graph) == []


def test_only_the_scheduler_changes_kv_blocks():
    """Every sequence and block state change sits in the scheduler, next to its KV consequence:
    the engine and the model runner never reach the block manager."""
    for module in ("engine/llm_engine.py", "engine/model_runner.py", "ipc/server.py"):
        tree = ast.parse((ROOT / module).read_text())
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert not names & {"block_manager", "bm", "BlockManager"}, module


# What a Sequence holds that the scheduler owns: its state, its progress through the KV cache
# and the draft tokens a step verifies. (`metrics` is timing, written where it is measured.)
SEQUENCE_STATE = {
    "state",
    "finish_reason",
    "num_computed_tokens",
    "num_cached_tokens",
    "block_table",
    "num_hashed_blocks",
    "spec_tokens",
    "spec_probs",
    "draft_computed",
    "token_ids",
}
KV_OWNERS = {"engine/scheduler.py", "engine/block_manager.py", "engine/sequence.py"}


def _state_writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, field) of every assignment to a SEQUENCE_STATE attribute of anything but `self`,
    and every in-place change of one (append/extend/del on `x.token_ids`, ...)."""
    out = []

    def targets(node):
        if isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                yield from targets(elt)
        elif isinstance(node, ast.Subscript):
            yield node.value
        else:
            yield node

    for node in ast.walk(tree):
        found = []
        if isinstance(node, ast.Assign):
            found = [t for tgt in node.targets for t in targets(tgt)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            found = list(targets(node.target))
        elif isinstance(node, ast.Delete):
            found = [t for tgt in node.targets for t in targets(tgt)]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"append", "extend", "pop", "clear", "insert", "remove"}
        ):
            found = [node.func.value]
        for t in found:
            if (
                isinstance(t, ast.Attribute)
                and t.attr in SEQUENCE_STATE
                and not (isinstance(t.value, ast.Name) and t.value.id == "self")
            ):
                out.append((t.lineno, t.attr))
    return sorted(out)


def test_only_the_scheduler_changes_a_sequences_state():
    """Finishing, progress through the KV cache and draft tokens change in the scheduler (and its
    block manager) only: the output processor, speculation, the engine and the simulator's
    replicas call its methods. Any module that handles Sequences is checked."""
    checked = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if rel in KV_OWNERS or not (rel.startswith(("engine/", "sim/")) or "Sequence" in text):
            continue
        checked.append(rel)
        writes = _state_writes(ast.parse(text))
        assert not writes, f"{rel} changes sequence state itself: {writes}"
    assert {"engine/emitter.py", "engine/speculative.py", "engine/llm_engine.py", "sim/replica.py"} <= set(checked)
    # the checker sees what it looks for
    assert _state_writes(
        ast.parse(
            "seq.finish_reason = 'stop'\nreq.seq.spec_tokens, x = [], 1\n"
            "s.token_ids.append(3)\ndel seq.token_ids[-1:]\nself.state = 1"
        )
    ) == [(1, "finish_reason"), (2, "spec_tokens"), (3, "token_ids"), (4, "token_ids")]


def test_metric_and_status_keys_are_defined_once():
    """`workbench.reports` names every metric and status key; every other place that reads or
    maps them uses those names (Prometheus mapping, remote servers' metrics, the lab panel)."""
    import re

    from workbench.http import metrics as prom
    from workbench.remote.prometheus import parse_prometheus, server_metrics
    from workbench.reports import EngineMetrics, EngineStatus, ProcessStatus, metric_fields

    fields = set(metric_fields())
    assert {key for _, key, _ in prom._COUNTERS + prom._GAUGES} <= fields
    vllm = parse_prometheus(
        "vllm:num_requests_running 3\nvllm:num_requests_waiting 2\nvllm:kv_cache_usage_perc 0.5\n"
        "vllm:prefix_cache_hits_total 5\nvllm:prefix_cache_queries_total 10\nvllm:generation_tokens_total 7\n"
        "vllm:prompt_tokens_total 9\n"
    )
    assert set(server_metrics(vllm)) <= fields and server_metrics(vllm)["num_running"] == 3
    model_ts = (ROOT.parent / "extension" / "src" / "model.ts").read_text()
    panel_reads = set(re.findall(r"metrics\.([a-z_0-9]+)", model_ts))
    assert panel_reads and panel_reads <= fields, panel_reads - fields
    panel_ts = (ROOT.parent / "extension" / "src" / "panel.ts").read_text()
    assert set(re.findall(r"status\.status\.([a-z_0-9]+)", panel_ts)) <= set(ProcessStatus.__struct_fields__)
    assert set(EngineStatus.__struct_fields__) <= set(ProcessStatus.__struct_fields__)
    assert "total_preemptions" in EngineMetrics.__struct_fields__


def test_event_kinds_are_defined_once():
    """The event kinds live in `events.EVENT_KINDS`; no other module spells the list out."""
    import re

    spelled = re.compile(r"""["']timeline["'],\s*["']settings["'],\s*["']relayout["']""")
    found = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if spelled.search(p.read_text())]
    assert found == ["events.py"], found


def _transport_users(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of the engine process's wire protocol from outside its package."""
    return sorted(
        (mod, dep)
        for mod, deps in graph.items()
        for dep in deps
        if dep.startswith("workbench.ipc.protocol") and not mod.startswith("workbench.ipc")
    )


def test_shared_types_are_not_the_transports():
    """Errors, events and limits live in `errors`, `events` and `settings`: a client or front that
    imports them from `ipc.protocol` (so an HTTP client would raise an IPC error) fails here."""
    known = _modules()
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    assert _transport_users(graph) == []
    assert _transport_users({"workbench.remote.wire": {"workbench.ipc.protocol.EngineDeadError"}}) == [
        ("workbench.remote.wire", "workbench.ipc.protocol.EngineDeadError")
    ]


# The layers, bottom up. The core serves requests (engine, models, transports, HTTP front, the
# shared structs); the tools measure and model it (bench, sweeps, run log, simulator); the fronts
# put both in front of a person. Imports point down only; `cluster`, `llm` and `engines` compose
# the core and are imported by fronts and tools, never by the core.
CORE = {
    "aio",
    "engine",
    "models",
    "ipc",
    "remote",
    "http",
    "events",
    "errors",
    "interface",
    "outputs",
    "reports",
    "sampling_params",
    "settings",
    "timeline",
    "tokenizer",
    "processing",
    "bokehjs",
}
TOOLS = {"bench", "tuning", "runs", "sim"}
FRONTS = {"jupyter", "jupyter_server", "cli"}


def _layer_breaks(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    def top(name: str) -> str:
        return name.split(".")[1] if "." in name else ""

    out = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if (top(mod) in CORE and top(dep) not in CORE) or (top(mod) in TOOLS and top(dep) in FRONTS):
                out.append((mod, dep))
    return out


# Within the core, bottom up (docs/design/architecture-3.md, section 1): the shared contracts, the
# engine and its models, the transport, the clients of an engine elsewhere, the HTTP front. A
# package imports only its own layer and those below.
CORE_LAYERS = (
    {
        "aio",
        "sampling_params",
        "outputs",
        "reports",
        "timeline",
        "settings",
        "errors",
        "events",
        "interface",
        "tokenizer",
        "processing",
        "bokehjs",
    },
    {"engine", "models"},
    {"ipc"},
    {"remote"},
    {"http"},
)


def _core_layer_breaks(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    level = {pkg: i for i, layer in enumerate(CORE_LAYERS) for pkg in layer}

    def top(name: str) -> str:
        return name.split(".")[1] if "." in name else ""

    return [
        (mod, dep)
        for mod, deps in sorted(graph.items())
        for dep in sorted(deps)
        if top(mod) in level and top(dep) in level and level[top(dep)] > level[top(mod)]
    ]


def test_the_core_layers_point_down():
    assert set().union(*CORE_LAYERS) == CORE  # every core package has its layer
    known = _modules()
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    assert _core_layer_breaks(graph) == []
    # the engine process's sockets never reach the engine: only its loop does (server.py)
    assert not {d for d in graph["workbench.ipc.transport"] if d.startswith("workbench.engine")}
    # the check sees a contract reaching up into the engine and the engine into its transport
    assert _core_layer_breaks(
        {
            "workbench.outputs": {"workbench.engine.sequence"},
            "workbench.engine.llm_engine": {"workbench.ipc.server", "workbench.models.loader"},
            "workbench.http.app": {"workbench.remote.client"},
        }
    ) == [("workbench.engine.llm_engine", "workbench.ipc.server"), ("workbench.outputs", "workbench.engine.sequence")]


def test_layers_point_down():
    known = _modules()
    assert {n.split(".")[1] for n in known if "." in n} >= CORE | TOOLS | FRONTS  # every name is a package
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    assert _layer_breaks(graph) == []
    # the check sees an upward import, lazy or not
    assert _layer_breaks(
        {
            "workbench.http.server": {"workbench.cluster"},
            "workbench.runs.plots": {"workbench.jupyter.views"},
            "workbench.jupyter.magics": {"workbench.runs"},
        }
    ) == [("workbench.http.server", "workbench.cluster"), ("workbench.runs.plots", "workbench.jupyter.views")]


def _imports_c_kernels(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name == "workbench_kernels.cpu" for a in node.names):
            return True
        if (
            isinstance(node, ast.ImportFrom)
            and node.module in ("workbench_kernels", "workbench_kernels.cpu")
            and (node.module.endswith(".cpu") or any(a.name == "cpu" for a in node.names))
        ):
            return True
    return False


def test_one_owner_of_the_cpu_fast_path():
    """Our C kernels are entered through the CPU fast path (models/cpu_forward.py: binding,
    attention ops and metadata, forward, report, matmul rate) and the linear layer's own weights;
    the attention backends, the roofline and the simulator go through the fast path."""
    users = sorted(str(path.relative_to(ROOT)) for path in _modules().values() if _imports_c_kernels(path))
    assert users == ["models/cpu_forward.py", "models/linear.py"], users
    # the check sees both spellings
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for text in (
            "from workbench_kernels import cpu\n",
            "import workbench_kernels.cpu as c\n",
            "def f():\n    from workbench_kernels.cpu import fused_max_rows\n",
        ):
            (Path(d) / "m.py").write_text(text)
            assert _imports_c_kernels(Path(d) / "m.py"), text


def test_a_top_level_kernels_import_from_the_checkout_root_gets_hugging_faces():
    """`python -m ...` started at the checkout's root puts it first on sys.path, where the kernels/
    folder (installed as workbench_kernels) shadows the name of Hugging Face's `kernels` package,
    which transformers imports when it is installed. That import gets Hugging Face's package, or,
    where it is not installed, an empty module (transformers probes for the package by importing
    it, and an error there broke vLLM's server started from the root)."""
    import importlib.metadata
    import subprocess
    import sys

    code = "import kernels, workbench_kernels.cpu as c; print(kernels.__file__); print(c.__name__)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT.parent, capture_output=True, text=True, timeout=120)
    try:
        installed = bool(importlib.metadata.version("kernels"))
    except importlib.metadata.PackageNotFoundError:
        installed = False
    assert r.returncode == 0, r.stderr
    path, cpu_module = r.stdout.split()
    assert cpu_module == "workbench_kernels.cpu"
    if installed:
        assert Path(path).parent.parent != ROOT.parent and "site-packages" in path
    else:
        assert Path(path).parent.parent == ROOT.parent


# No module past 600 lines (issue 48: "no module over 600 lines without a split that reads
# better"; docs/design/architecture-3.md, section 5): a module that grows past it is split.
MAX_LINES = 600


def _too_long(sizes: dict[str, int]) -> list[tuple[str, int]]:
    return sorted((name, n) for name, n in sizes.items() if n > MAX_LINES)


def test_no_module_grows_past_600_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert _too_long(sizes) == []
    # the check sees a module past the line
    assert _too_long({"workbench.llm": 601, "workbench.ipc.client": 611, "workbench.events": 80}) == [
        ("workbench.ipc.client", 611),
        ("workbench.llm", 601),
    ]
