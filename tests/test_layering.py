"""The package's layering: imports among mot_jax modules point one way, and each shared rule lives in one place."""

import ast
from pathlib import Path

from mot_jax.models import decoder, tiny
from mot_jax.models.registry import FAMILIES, FAMILY_BY_NAME

PACKAGE = Path(__file__).resolve().parent.parent / "mot_jax"


def import_graph(package: Path) -> dict[str, set[str]]:
    """{module: the mot_jax modules it imports}. Every import statement counts, also one inside a function: an
    import deferred into a function to dodge a cycle is still a cycle."""
    modules = {}
    for path in package.rglob("*.py"):
        name = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from a.b import c`: a.b, and a.b.c when c is a module
                imported |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        if "pkgutil.iter_modules(__path__)" in path.read_text():  # a package that imports all its modules
            imported |= {m for m in modules if m.startswith(name + ".") and "." not in m[len(name) + 1 :]}
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (depth-first search for an edge back into the path)."""
    done = set()

    def visit(node, path):
        for nxt in sorted(graph[node]):
            if nxt in path:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in done and (cycle := visit(nxt, path + [nxt])):
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done and (cycle := visit(start, [start])):
            return cycle
    return None


def test_find_cycle_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_mot_jax_imports_have_no_cycle():
    graph = import_graph(PACKAGE)
    assert {"mot_jax.models.loading", "mot_jax.models.registry", "mot_jax.paths"} <= set(graph)  # the parse saw them
    assert "mot_jax.models.registry" in graph["mot_jax.models.tiny"]  # `from pkg import module` edges are seen
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# the layers, bottom up (docs/architecture.md): a part may import its own layer and those below, never one above
LAYERS = [("kernels",), ("models",), ("translate",), ("training",), ("evals",), ("bench", "export")]


def test_imports_point_down_the_layers():
    """No module of `translate` imports `training`, `evals`, `bench` or `export`; none of `training` imports `evals`,
    `bench` or `export`; and so on up (docs/architecture.md, "What imports what")."""
    rank = {f"mot_jax.{part}": i for i, parts in enumerate(LAYERS) for part in parts}
    layer = lambda module: next((rank[p] for p in rank if module == p or module.startswith(p + ".")), None)
    upward = [
        (module, imported)
        for module, imports in import_graph(PACKAGE).items()
        for imported in imports
        if layer(module) is not None and layer(imported) is not None and layer(imported) > layer(module)
    ]
    assert ("mot_jax.evals.run", "mot_jax.training.trained") in {
        (m, i) for m, imports in import_graph(PACKAGE).items() for i in imports
    }  # the graph sees a downward import
    assert not upward, upward


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
TEXT_INTRO = "The same as text (each line: a part and the parts of mot_jax it imports"
# the parts drawn as boxes of their own in the doc's picture (the rest are the utilities at the bottom)
DRAWN = {"train", "evaluate", "convert", "bench", "export", "evals", "training", "translate", "models", "kernels"}
DRAWN |= {"multihost", "tfds_builders"}


def part_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """{part: the parts it imports}: a part is a subpackage of mot_jax or a top-level module (`train`, `errors`)."""
    part = lambda module: module.split(".")[1]
    parts = {}
    for module, imports in graph.items():
        if module != "mot_jax":
            parts.setdefault(part(module), set()).update(part(i) for i in imports if i != "mot_jax")
    return {name: imported - {name} for name, imported in parts.items()}


def doc_block(text: str, after: str, fence: str) -> list[str]:
    """The lines of the first fenced block (opening with `fence`) after the line starting with `after`."""
    start = text.index(fence, text.index(after)) + len(fence)
    return text[start : text.index("```", start)].strip("\n").splitlines()


def test_the_architecture_docs_import_picture_is_the_codes():
    """docs/architecture.md's "What imports what": its text lists every part's imports as the code has them, and its
    picture draws an arrow for every import between the drawn parts and none that is not one."""
    parts = part_graph(import_graph(PACKAGE))
    text = ARCHITECTURE.read_text()
    listed = {}
    for line in doc_block(text, TEXT_INTRO, "```\n"):
        name, _, imported = line.partition(":")
        listed[name.strip()] = set(imported.split()) - {"-"}
    expected = "\n".join(f"{name}: {' '.join(sorted(parts[name])) or '-'}" for name in sorted(parts))
    assert listed == parts, f"docs/architecture.md's import list is out of date; it should read:\n{expected}"
    utilities = set(parts) - DRAWN
    arrows = set()
    for line in doc_block(text, "## What imports what", "```mermaid\n")[1:]:
        a, b = (side.strip().split("[")[0] for side in line.split("-->"))
        arrows |= {(a, u) for u in utilities} if b == "util" else {(a, b)}
    drawn = {(a, b) for a, imported in parts.items() for b in imported if a in DRAWN and b in DRAWN}
    assert drawn <= arrows, f"the picture lacks {sorted(drawn - arrows)}"
    assert all(b in parts[a] for a, b in arrows if b in DRAWN), "the picture draws an import the code does not make"
    assert all(parts[a] & utilities for a, b in arrows if b in utilities), "an arrow to the utilities is not one"


def test_rotary_property_agrees_with_the_model_classes():
    """`ModelConfig.rotary` (the one rule translate and export use) is true exactly for the families whose model
    class applies RoPE (decoder.RotaryLM)."""
    seen = set()
    for family in tiny.HF_CONFIGS:
        hf = tiny.hf_config(tiny.PREFIX + family)
        cfg = FAMILIES[hf["model_type"]][0].config_from_hf(hf)
        assert cfg.rotary == issubclass(FAMILY_BY_NAME[cfg.family][1], decoder.RotaryLM), cfg.family
        seen.add(cfg.family)
    assert seen == set(FAMILY_BY_NAME)
