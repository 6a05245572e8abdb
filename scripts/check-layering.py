#!/usr/bin/env python3
"""Checks that no file of the workspace imports another in a circle, and that crates
depend on each other only in the intended layers.

File graph: for every crate of the workspace (and fuzz/), every target root (lib.rs,
main.rs, bin/, tests/, benches/, examples/) and the files its `mod` declarations reach.
File A depends on file B when A names an item that B defines: through `use` trees and
through paths written inline (`crate::a::b::f()`, `super::X`, `child::Y`, and paths
that start with a name A imported). A path is resolved through the module tree and
through re-exports (`pub use`) to the file that defines its item. `mod` declarations
themselves are not edges: a module tree is ownership, and a child that names an item
of its parent is ordinary; but a parent that also names an item of that child is a
circle, and is reported.

Crate graph: cargo already refuses crate cycles; this checks the intended layering
(which crate may depend on which), from each Cargo.toml's [dependencies] and
[dev-dependencies] and from the crate names paths actually use.

Usage: scripts/check-layering.py [--graph] [--root DIR] [--self-test]
  --graph      print every file's dependencies (for reading, not for CI)
  --self-test  check the checker: a made-up crate with a circle must fail, and the
               same crate without it must pass
Exit status 1 when a cycle or a layering violation is found.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tomllib
from dataclasses import dataclass, field

# Which workspace crates each crate may depend on (normal and dev dependencies, and
# paths it names). A crate missing here may depend on no workspace crate.
LEAVES = {"cube-storage", "cube-mem", "cube-net", "cube-jail", "cube-agent", "cube-archive"}
ALLOWED = {
    "cube-storage": set(),
    # The portable snapshot archive format: bytes and directory trees, nothing of Cube's.
    "cube-archive": set(),
    "cube-agent": set(),
    "cube-net": set(),
    "cube-mem": {"cube-storage"},
    # cube-jail's tests start a real agent as a jail's init.
    "cube-jail": {"cube-storage", "cube-agent"},
    # cube-net and cube-agent for tests only: the net device behind a real pool TAP,
    # the agent's protocol over the vsock device.
    "cube-devices": {"cube-storage", "cube-mem", "cube-net", "cube-agent"},
    "cube-vmm": {"cube-devices", "cube-mem", "cube-storage", "cube-agent"},
    "cube-supervisor": {"cube-vmm", "cube-devices", "cube-mem", "cube-storage",
                        "cube-jail", "cube-net", "cube-agent"},
    "cube-core": {"cube-supervisor", "cube-vmm", "cube-devices", "cube-mem",
                  "cube-storage", "cube-jail", "cube-net", "cube-agent", "cube-archive"},
    # Frontends: the public API of cube-core, plus the agent's protocol types.
    # The service: on cube-core's public API, the agent's protocol for envd's calls.
    "cube-server": {"cube-core", "cube-agent"},
    "cube-cli": {"cube-core", "cube-agent", "cube-server"},
    "cube-py": {"cube-core", "cube-agent"},
    "benches": {"cube-core", "cube-agent"},
    # The containerd shim is a frontend too.
    "cube-shim": {"cube-core", "cube-agent"},
    # `cargo xtask` runs cargo and the scripts; it links no Cube crate.
    "xtask": set(),
    # Holds no code: its dependency list unifies external crates' features across the
    # workspace (cargo-hakari), so any cargo selection reuses the same builds.
    "cube-workspace-hack": set(),
    # Fuzz targets reach the parsers of untrusted bytes where they live (cube serve's
    # Connect framing in cube-server).
    "fuzz": {"cube-storage", "cube-devices", "cube-vmm", "cube-supervisor", "cube-agent",
             "cube-archive", "cube-server"},
}

WORKSPACE_HACK = "cube-workspace-hack"

ITEM_RE = re.compile(
    r"\b(?:fn|struct|enum|union|trait|type|const|static|macro_rules!)\s+(r#)?([A-Za-z_]\w*)"
)
MOD_RE = re.compile(r"\bmod\s+([A-Za-z_]\w*)\s*(;|\{)")
PATH_ATTR_RE = re.compile(r'#\[path\s*=\s*"([^"]+)"\]')
USE_RE = re.compile(r"\b(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);")
INLINE_PATH_RE = re.compile(r"(?<![\w:])((?:::)?[A-Za-z_]\w*(?:\s*::\s*[A-Za-z_]\w*)+)")
KEYWORDS = {"crate", "super", "self", "Self"}


def strip_code(src: str) -> str:
    """Blanks comments and string/char literals (keeping newlines and braces of code)."""
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif (m := re.match(r'(?:b|c)?r(#*)"', src[i:i + 260])) and (
            i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")
        ):
            end = '"' + m.group(1)
            j = src.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            j += 1
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == "'":
            # A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if i + 1 < n and src[i + 1] == "\\":
                j = src.find("'", i + 2)
                j = n if j < 0 else j + 1
                out.append(" " * (j - i))
                i = j
            elif i + 2 < n and src[i + 2] == "'":
                out.append("   ")
                i += 3
            elif i + 1 < n and ord(src[i + 1]) > 127:
                j = src.find("'", i + 1)
                j = n if j < 0 or j - i > 6 else j + 1
                out.append(" " * (j - i))
                i = j
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def parse_use_tree(tree: str, prefix: list[str]) -> list[tuple[list[str], str | None]]:
    """Expands a use tree into (path, alias) pairs; alias None for globs."""
    tree = tree.strip()
    if not tree:
        return []
    # Split off a leading path before a brace group.
    depth = 0
    for k, ch in enumerate(tree):
        if ch == "{":
            if depth == 0:
                head = tree[:k].strip().rstrip(":").strip()
                inner = tree[k + 1:tree.rfind("}")]
                base = prefix + [s.strip() for s in head.split("::") if s.strip()]
                parts, d, start = [], 0, 0
                for m, ch2 in enumerate(inner):
                    if ch2 == "{":
                        d += 1
                    elif ch2 == "}":
                        d -= 1
                    elif ch2 == "," and d == 0:
                        parts.append(inner[start:m])
                        start = m + 1
                parts.append(inner[start:])
                result = []
                for p in parts:
                    result += parse_use_tree(p, base)
                return result
            depth += 1
    alias = None
    m = re.match(r"(.*?)\s+as\s+(\w+)$", tree)
    if m:
        tree, alias = m.group(1), m.group(2)
    segs = prefix + [s.strip() for s in tree.split("::") if s.strip()]
    if segs and segs[-1] == "*":
        return [(segs[:-1], None)]
    if segs and segs[-1] == "self":
        segs = segs[:-1]
    if not segs:
        return []
    return [(segs, alias or segs[-1])]


@dataclass
class Module:
    """One module: a file, or an inline `mod x { }` inside one."""
    crate: str
    path: tuple[str, ...]          # from the crate root
    file: str
    children: dict[str, "Module"] = field(default_factory=dict)
    items: set[str] = field(default_factory=set)
    imports: dict[str, list[str]] = field(default_factory=dict)  # name -> absolute path
    globs: list[list[str]] = field(default_factory=list)
    # (absolute path, line) of every path the module's own code names
    refs: list[tuple[list[str], int]] = field(default_factory=list)
    parent: "Module | None" = None


class Crate:
    def __init__(self, name: str, ident: str, roots: list[str]):
        self.name = name
        self.ident = ident
        self.roots = roots


def attributes_before(raw: str, line_start: int) -> str:
    """The attribute lines (`#[...]`) just above the line that starts at `line_start`."""
    lines = raw[:max(line_start, 0)].split("\n")
    attrs = []
    for line in reversed(lines):
        if line.strip().startswith("#["):
            attrs.append(line.strip())
        elif line.strip() and not line.strip().startswith("//"):
            break
    return " ".join(attrs)


def is_test_only(attrs: str) -> bool:
    """Whether `#[cfg(...)]` attributes compile an item in test builds only."""
    for cfg in re.findall(r"#\[cfg\((.*?)\)\]", attrs):
        if re.search(r"(?<!not\()\btest\b", cfg) and (cfg == "test" or cfg.startswith("all(")):
            return True
    return False


def module_dir(file: str, is_root: bool) -> str:
    base = os.path.basename(file)
    if is_root or base == "mod.rs":
        return os.path.dirname(file)
    return os.path.splitext(file)[0]


class Parser:
    def __init__(self, crate_ident: str, known_crates: set[str]):
        self.crate_ident = crate_ident
        self.known_crates = known_crates
        self.modules: list[Module] = []
        self.extern_refs: list[tuple[str, str, int]] = []  # (file, crate ident, line)

    def load_file(self, file: str, crate_path: tuple[str, ...], is_root: bool,
                  parent: Module | None) -> Module:
        with open(file, encoding="utf-8") as f:
            raw = f.read()
        src = strip_code(raw)
        mod = Module(self.crate_ident, crate_path, file, parent=parent)
        self.modules.append(mod)
        self.parse_body(src, raw, 0, len(src), mod, module_dir(file, is_root), file)
        return mod

    def parse_body(self, src: str, raw: str, start: int, end: int, mod: Module,
                   dir_: str, file: str) -> None:
        i = start
        line_of = lambda pos: src.count("\n", 0, pos) + 1  # noqa: E731
        body_parts = []
        while i < end:
            m = MOD_RE.search(src, i, end)
            if not m:
                body_parts.append((i, end))
                break
            body_parts.append((i, m.start()))
            name = m.group(1)
            # Attributes on the line(s) just before: #[path = "..."]
            line_start = src.rfind("\n", 0, m.start())
            path_attr = PATH_ATTR_RE.search(attributes_before(raw, line_start).replace(" #[", "\n#["))
            if m.group(2) == ";":
                if path_attr:
                    cand = [os.path.join(os.path.dirname(file), path_attr.group(1))]
                else:
                    cand = [os.path.join(dir_, name + ".rs"), os.path.join(dir_, name, "mod.rs")]
                target = next((c for c in cand if os.path.exists(c)), None)
                if target:
                    child = self.load_file(target, mod.path + (name,), False, mod)
                    mod.children[name] = child
                mod.items.add(name)
                i = m.end()
            else:
                # Inline module: find its closing brace.
                depth, j = 1, m.end()
                while j < end and depth:
                    if src[j] == "{":
                        depth += 1
                    elif src[j] == "}":
                        depth -= 1
                    j += 1
                # A `#[cfg(test)]` inline module is a node of its own: nothing imports
                # it, so the tests of a file never put that file in a circle.
                node = f"{file}#{name}" if is_test_only(attributes_before(raw, line_start)) else file
                child = Module(self.crate_ident, mod.path + (name,), node, parent=mod)
                self.modules.append(child)
                mod.children[name] = child
                mod.items.add(name)
                self.parse_body(src, raw, m.end(), j - 1, child, os.path.join(dir_, name), file)
                i = j
        # Keep positions: scan each part separately.
        for a, b in body_parts:
            part = src[a:b]
            for im in ITEM_RE.finditer(part):
                mod.items.add(im.group(2))
            for um in USE_RE.finditer(part):
                line = line_of(a + um.start())
                for segs, alias in parse_use_tree(um.group(2), []):
                    segs = [s for s in segs]
                    if segs and segs[0] == "":
                        segs = segs[1:]
                    if alias is None:
                        mod.globs.append(segs)
                    else:
                        mod.imports[alias] = segs
                        if um.group(1):
                            mod.items.add(alias)
                    mod.refs.append((segs, line))
            masked = USE_RE.sub(lambda mm: " " * len(mm.group(0)), part)
            for pm in INLINE_PATH_RE.finditer(masked):
                segs = [s.strip() for s in pm.group(1).split("::") if s.strip()]
                mod.refs.append((segs, line_of(a + pm.start())))


def resolve_start(mod: Module, segs: list[str], root: Module, crates: dict[str, Crate]):
    """Turns a path as written in `mod` into (crate ident, absolute segments), or None
    for paths outside the workspace (std, external crates, locals, enum variants)."""
    if not segs:
        return None
    head = segs[0]
    if head == "crate":
        return (mod.crate, segs[1:])
    if head in ("self", "Self"):
        if head == "Self":
            return None
        return (mod.crate, list(mod.path) + segs[1:])
    if head == "super":
        m, k = mod, 0
        while k < len(segs) and segs[k] == "super":
            m = m.parent if m.parent else m
            k += 1
        return (mod.crate, list(m.path) + segs[k:])
    if head in mod.children:
        return (mod.crate, list(mod.path) + segs)
    if head in mod.imports:
        target = mod.imports[head]
        if target and target[0] in ("crate", "self", "super") or (target and target[0] in mod.children):
            r = resolve_start(mod, target, root, crates)
            if r is None:
                return None
            return (r[0], r[1] + segs[1:])
        if target and target[0] in crates:
            return (target[0], target[1:] + segs[1:])
        return None
    if head in crates:
        return (head, segs[1:])
    return None


def find_file(crate_mods: dict[tuple[str, ...], Module], segs: list[str], depth: int = 0):
    """The file that defines what an absolute path (within one crate) names."""
    if depth > 20:
        return None
    root = crate_mods.get(())
    m = root
    k = 0
    while k < len(segs):
        s = segs[k]
        if s in m.children:
            m = m.children[s]
            k += 1
            continue
        if s in m.imports and s not in _defined_here(m):
            target = m.imports[s]
            r = resolve_start(m, target, root, {})
            if r is not None:
                found = find_file(crate_mods, r[1] + segs[k + 1:], depth + 1)
                if found:
                    return found
        if s not in m.items:
            for g in m.globs:
                r = resolve_start(m, g + [s], root, {})
                if r is not None:
                    found = find_file(crate_mods, r[1] + segs[k + 1:], depth + 1)
                    if found and found != m.file:
                        return found
        return m.file
    return m.file


def _defined_here(m: Module) -> set[str]:
    return {i for i in m.items if i not in m.imports}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan), each as a cycle."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]
    sys.setrecursionlimit(100000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in out:
        comp_set = set(comp)
        # One concrete cycle through the component's first file (BFS back to it).
        startv = sorted(comp)[0]
        prev = {startv: None}
        queue = [startv]
        found = None
        while queue and not found:
            v = queue.pop(0)
            for w in sorted(graph.get(v, ())):
                if w not in comp_set:
                    continue
                if w == startv:
                    found = v
                    break
                if w not in prev:
                    prev[w] = v
                    queue.append(w)
        path = []
        v = found
        while v is not None:
            path.append(v)
            v = prev[v]
        cycles.append((sorted(comp), list(reversed(path)) + [startv]))
    return cycles


def crate_targets(crate_dir: str, manifest: dict) -> list[str]:
    roots = []
    for rel in ("src/lib.rs", "src/main.rs", "build.rs"):
        if os.path.exists(os.path.join(crate_dir, rel)):
            roots.append(rel)
    for sub in ("src/bin", "tests", "benches", "examples", "fuzz_targets"):
        d = os.path.join(crate_dir, sub)
        if os.path.isdir(d):
            for name in sorted(os.listdir(d)):
                p = os.path.join(sub, name)
                if name.endswith(".rs"):
                    roots.append(p)
                elif os.path.exists(os.path.join(crate_dir, p, "main.rs")):
                    roots.append(os.path.join(p, "main.rs"))
    for key in ("bin", "test", "bench", "example"):
        for t in manifest.get(key, []):
            if "path" in t and t["path"] not in roots:
                roots.append(t["path"])
    lib = manifest.get("lib", {})
    if "path" in lib and lib["path"] not in roots:
        roots.append(lib["path"])
    return roots


def self_test() -> int:
    """Runs the checker on a made-up workspace, with and without a circle."""
    import subprocess
    import tempfile

    files = {
        "Cargo.toml": '[workspace]\nmembers = ["cube-storage"]\n',
        "cube-storage/Cargo.toml": '[package]\nname = "cube-storage"\n',
        "cube-storage/src/lib.rs": "pub mod a;\npub mod b;\npub use a::Alpha;\n",
        "cube-storage/src/a.rs": "use crate::b::Beta;\npub struct Alpha(Beta);\n",
        "cube-storage/src/b.rs": "pub struct Beta;\n",
    }
    circle = "use super::a::Alpha;\npub struct Beta;\npub fn f(_: &Alpha) {}\n"
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        run = lambda: subprocess.run(  # noqa: E731
            [sys.executable, __file__, "--root", tmp], capture_output=True, text=True
        )
        clean = run()
        with open(os.path.join(tmp, "cube-storage/src/b.rs"), "w") as f:
            f.write(circle)
        cyclic = run()
    ok = clean.returncode == 0 and cyclic.returncode == 1 and "src/b.rs" in cyclic.stderr
    print(f"check-layering self-test: {'ok' if ok else 'FAILED'}")
    if not ok:
        print(clean.stdout, clean.stderr, cyclic.stdout, cyclic.stderr, file=sys.stderr)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), ".."))
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    root = os.path.abspath(args.root)
    with open(os.path.join(root, "Cargo.toml"), "rb") as f:
        ws = tomllib.load(f)
    members = list(ws["workspace"]["members"]) + list(ws["workspace"].get("exclude", []))

    crates: dict[str, Crate] = {}
    manifests = {}
    for member in members:
        d = os.path.join(root, member)
        mf = os.path.join(d, "Cargo.toml")
        if not os.path.exists(mf):
            continue
        with open(mf, "rb") as f:
            manifest = tomllib.load(f)
        name = manifest["package"]["name"]
        key = member if member in ("fuzz", "benches") else name
        manifests[key] = (d, manifest)
        crates[name.replace("-", "_")] = Crate(key, name.replace("-", "_"), [])

    problems = 0
    graph: dict[str, set[str]] = {}
    why: dict[tuple[str, str], int] = {}
    crate_uses: dict[str, set[str]] = {}
    ws_idents = set(crates)
    for key, (d, manifest) in manifests.items():
        ident = manifest["package"]["name"].replace("-", "_")
        for rel in crate_targets(d, manifest):
            file = os.path.join(d, rel)
            target_ident = ident if rel in ("src/lib.rs",) or rel == manifest.get("lib", {}).get("path") else f"{ident}[{rel}]"
            parser = Parser(target_ident, ws_idents)
            rootmod = parser.load_file(file, (), True, None)
            crate_mods = {m.path: m for m in parser.modules}
            # This target's own crate paths resolve within it; its own library's
            # paths (`cube_core::x`) are a crate edge, as for any other crate.
            for m in parser.modules:
                graph.setdefault(m.file, set())
                for segs, line in m.refs:
                    r = resolve_start(m, segs, rootmod, crates)
                    if r is None:
                        continue
                    c, abs_segs = r
                    if c != target_ident:
                        if c in crates:
                            crate_uses.setdefault(key, set()).add(crates[c].name)
                        continue
                    t = find_file(crate_mods, abs_segs)
                    if t and t != m.file:
                        graph[m.file].add(t)
                        why.setdefault((m.file, t), line)

    rel = lambda p: os.path.relpath(p, root)  # noqa: E731
    if args.graph:
        for f in sorted(graph):
            for t in sorted(graph[f]):
                print(f"{rel(f)}:{why[(f, t)]} -> {rel(t)}")

    for comp, cyc in find_cycles(graph):
        problems += 1
        print(f"cycle among {len(comp)} files:", file=sys.stderr)
        for a, b in zip(cyc, cyc[1:]):
            print(f"  {rel(a)}:{why[(a, b)]} uses {rel(b)}", file=sys.stderr)
        if len(comp) > len(cyc) - 1:
            print("  (component: " + ", ".join(rel(c) for c in comp) + ")", file=sys.stderr)

    names = {c.name for c in crates.values()}
    for key, (d, manifest) in manifests.items():
        deps = set()
        for section in ("dependencies", "dev-dependencies", "build-dependencies"):
            for dep in manifest.get(section, {}):
                if dep in names:
                    deps.add(dep)
        deps |= crate_uses.get(key, set())
        deps.discard(manifest["package"]["name"])
        # Its targets' uses of its own library (fuzz/'s targets share cube_fuzz),
        # recorded under the key the table uses.
        deps.discard(key)
        # Any crate may take the workspace-hack: it is a feature list, not a layer.
        deps.discard(WORKSPACE_HACK)
        allowed = ALLOWED.get(key)
        if allowed is None:
            print(f"layering: {key} is not in scripts/check-layering.py's ALLOWED table",
                  file=sys.stderr)
            problems += 1
            continue
        for dep in sorted(deps - allowed):
            print(f"layering: {key} may not depend on {dep}", file=sys.stderr)
            problems += 1

    files = len(graph)
    edges = sum(len(v) for v in graph.values())
    if problems:
        print(f"check-layering: {problems} problem(s) in {files} files, {edges} edges",
              file=sys.stderr)
        return 1
    print(f"check-layering: no cycles among {files} files ({edges} edges); "
          f"{len(manifests)} crates layered as intended")
    return 0


if __name__ == "__main__":
    sys.exit(main())
