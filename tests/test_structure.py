"""The package's shape: no import cycles between jaxllm's modules, and no module grown past MAX_LINES.

The import graph is read from the source with `ast`, every import statement counted, those inside functions
included (an import deferred into a function still ties the two modules together; it only hides the cycle
from Python's loader). An edge goes to the module an import names: `from jaxllm.kernels import ffi` to
jaxllm.kernels.ffi, `from jaxllm.kernels import linear_reference` to the package jaxllm.kernels. The implicit
import of a module's parent package is left out (every module would otherwise form a cycle with it).
"""
import ast
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jaxllm"
MAX_LINES = 500


def _modules() -> dict[str, pathlib.Path]:
  """Dotted name -> file, for every source module of the package."""
  out = {}
  for path in sorted(ROOT.rglob("*.py")):
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


def _is_compiled(name: str) -> bool:
  """Whether `name` is a module of the package that has no source here (the built extension jaxllm._ffi)."""
  try:
    spec = importlib.util.find_spec(name)
  except (ImportError, ValueError):
    return False
  return spec is not None and spec.origin is not None and not spec.origin.endswith(".py")


def import_graph() -> dict[str, set[str]]:
  """Module -> the jaxllm modules it imports (anywhere in its source)."""
  modules = _modules()

  def owner(name: str) -> str:
    """The module a dotted name belongs to (a name defined in a module maps to that module)."""
    while name and name not in modules:
      name = name.rpartition(".")[0]
    return name

  graph = {}
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = package.split(".")
          base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
        targets = []
        for alias in node.names:
          full = f"{base}.{alias.name}"
          if full in modules or _is_compiled(full):
            targets.append(full)
          else:
            targets.append(base)
      else:
        continue
      for target in targets:
        if target.split(".")[0] != "jaxllm" or target not in modules and _is_compiled(target):
          continue
        module = owner(target)
        if module and module != name:
          edges.add(module)
    graph[name] = edges
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
  index, low, on_stack, stack, found = {}, {}, set(), [], []
  counter = 0
  for root in sorted(graph):
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = counter
    counter += 1
    stack.append(root)
    on_stack.add(root)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = counter
          counter += 1
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(sorted(graph.get(child, ())))))
        elif child in on_stack:
          low[node] = min(low[node], index[child])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[node])
      if low[node] == index[node]:
        component = []
        while True:
          member = stack.pop()
          on_stack.discard(member)
          component.append(member)
          if member == node:
            break
        if len(component) > 1:
          found.append(sorted(component))
  return found


def test_cycle_finder_finds_a_cycle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
  assert cycles(graph) == [["a", "b", "c"]]
  assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_imports_inside_functions():
  graph = import_graph()
  assert "jaxllm.kernels.ffi" in graph["jaxllm.kernels.linear"]
  assert "jaxllm.engine" in graph["jaxllm"]


def test_no_import_cycles():
  found = cycles(import_graph())
  assert not found, f"import cycles in jaxllm/ (each a set of modules that import one another): {found}"


def test_no_module_too_long():
  long = {str(p.relative_to(ROOT.parent)): n for p in _modules().values()
          if (n := len(p.read_text().splitlines())) > MAX_LINES}
  assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"
