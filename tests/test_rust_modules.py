"""No Rust source file imports another that imports it back, directly or around a loop, in any
crate of the workspace.

The graph has one node per file (`src/lib.rs`, `src/a.rs`, `src/a/mod.rs`, ...) and an edge from a
file to every other file of the same crate whose module (or an item in it) the file names by a
path: `use crate::a::b`, `use super::x::{y, z}`, `use self::c`, a relative `use child::x`, or
`super::x::f(...)` / `crate::a::f(...)` in code. Inline modules (`mod tests { ... }`) belong to
their file. Left out, as the module tree rather than imports: a file's paths into the files below
it (a crate root or `mod.rs` declares, re-exports and calls its children; they may use what it
defines), and intra-doc links in comments. So a loop always runs through files side by side, such
as two op files that borrow each other's helpers.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRIMITIVE_ROOTS = {"std", "core", "alloc"}


def crates():
    """(name, src folder) of every workspace member with a `src/lib.rs`."""
    members = re.search(r"members\s*=\s*\[([^\]]*)\]", (ROOT / "Cargo.toml").read_text()).group(1)
    for name in re.findall(r'"([^"]+)"', members):
        src = ROOT / name / "src"
        if (src / "lib.rs").is_file():
            yield name, src


def module_of(src, path):
    """Module path (tuple of names) of the file `path` under `src`."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("lib", "mod"):
        parts.pop()
    return tuple(parts)


def strip(text):
    """`text` without comments, string and char literals (kept line for line)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:]) and not re.match(r"\w", text[i - 1 : i]):
            hashes = re.match(r"r(#*)\"", text[i:]).group(1)
            end = '"' + hashes
            j = text.find(end, i + 2 + len(hashes))
            j = n if j < 0 else j + len(end)
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:]):
            i += len(re.match(r"'(\\.[^']*|[^\\'])'", text[i:]).group(0))
            out.append("' '")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def use_paths(tree):
    """The full paths of a use tree (`a::{b, c::{d, self}}` -> a::b, a::c::d, a::c)."""
    tree = re.sub(r"\s+", "", re.sub(r"\s+as\s+\w+", "", tree))
    if "{" not in tree:
        return [re.sub(r"::self$", "", tree)]
    head, _, rest = tree.partition("{")
    body = rest[: rest.rfind("}")]
    items, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    items.append(cur)
    out = []
    for item in filter(None, items):
        for p in use_paths(item):
            out.append(head + p if p not in ("self", "*") else head.rstrip(":"))
    return out


def scopes(code, file_module):
    """(module, path) for every `use` and every `crate::`/`super::`/`self::` path
    in code, with the inline module each one sits in; path None where an inline module opens."""
    stack = [(file_module, -1)]  # (module, brace depth where it opened)
    depth = 0
    token = re.compile(
        r"(?P<mod>\bmod\s+(?P<name>\w+)\s*\{)"
        r"|(?P<use>\buse\s+(?P<tree>[^;]+);)"
        r"|(?P<path>(?<![\w$:])(crate|self|super)(::\w+)+)"
        r"|(?P<open>\{)|(?P<close>\})"
    )
    for m in token.finditer(code):
        if m.group("mod"):
            depth += 1
            stack.append((stack[-1][0] + (m.group("name"),), depth))
            yield stack[-1][0], None
        elif m.group("use"):
            for p in use_paths(m.group("tree")):
                yield stack[-1][0], p
        elif m.group("path"):
            yield stack[-1][0], m.group("path")
        elif m.group("open"):
            depth += 1
        elif m.group("close"):
            if stack[-1][1] == depth:
                stack.pop()
            depth -= 1


def resolve(module, path, modules):
    """The module (a key of `modules`) `path`, written in `module`, names, or None."""
    parts = [p for p in path.split("::") if p]
    if not parts:
        return None
    if parts[0] == "crate":
        base, parts = (), parts[1:]
    elif parts[0] in ("self", "super"):
        base = module
        while parts and parts[0] in ("self", "super"):
            if parts.pop(0) == "super":
                base = base[:-1]
    elif parts[0] in PRIMITIVE_ROOTS:
        return None
    elif module + (parts[0],) in modules:
        base = module  # a relative path to a child module
    else:
        return None
    target = base
    for p in parts:
        if target + (p,) in modules:
            target = target + (p,)
        else:
            break
    return target


def graph(src):
    """file -> set of files (relative names) of one crate."""
    files = sorted(src.rglob("*.rs"))
    file_of = {}  # module -> file
    texts = {}
    for f in files:
        texts[f] = strip(f.read_text())
        file_of[module_of(src, f)] = f
    # Inline modules live in their file.
    for f in files:
        base = module_of(src, f)
        for mod_path, path in scopes(texts[f], base):
            if path is None:
                file_of.setdefault(mod_path, f)
    edges = {f: set() for f in files}
    for f in files:
        file_module = module_of(src, f)
        for module, path in scopes(texts[f], file_module):
            target = path and resolve(module, path, file_of)
            if target is None:
                continue
            # A file's paths into the files below it are the module tree.
            if len(target) > len(file_module) and target[: len(file_module)] == file_module:
                continue
            to = file_of[target]
            if to != f:
                edges[f].add(to)
    return edges


def find_cycle(edges):
    """One cycle as a list of files (first repeated at the end), or None."""
    state = {}
    for start in edges:
        if start in state:
            continue
        stack = [(start, iter(sorted(edges[start])))]
        path = [start]
        state[start] = "open"
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = "done"
                stack.pop()
                path.pop()
            elif state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = "open"
                stack.append((nxt, iter(sorted(edges[nxt]))))
                path.append(nxt)
    return None


def cycles(edges):
    """Every strongly connected component of more than one file, as sorted lists."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_workspace_crates_are_found():
    names = {name for name, _ in crates()}
    assert {"runtime", "compiler", "passes", "frontend_fx", "cache", "python"} <= names


def test_the_parser_sees_imports_and_cycles(tmp_path):
    """The check itself: a loop through `use super::`, a `crate::` path in code and a grouped
    use is found; a front's re-export, a test module's `use super::*` and a doc link are not
    edges."""
    src = tmp_path / "src"
    (src / "ops").mkdir(parents=True)
    (src / "lib.rs").write_text("mod ops;\npub use ops::a::A;\npub struct E;\n")
    (src / "ops" / "mod.rs").write_text("pub mod a;\npub mod b;\npub mod c;\n")
    (src / "ops" / "a.rs").write_text(
        "use super::{b::{self, f}, c};\npub struct A;\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n"
    )
    (src / "ops" / "b.rs").write_text(
        '/// See [`super::a`] and `crate::ops::a`.\npub fn f() { let _ = "super::a"; }\n'
    )
    (src / "ops" / "c.rs").write_text("pub fn g() { crate::ops::a::A; }\n")
    edges = graph(src)
    rel = {
        k.relative_to(src).as_posix(): sorted(v.relative_to(src).as_posix() for v in vs)
        for k, vs in edges.items()
    }
    assert rel == {
        "lib.rs": [],
        "ops/mod.rs": [],
        "ops/a.rs": ["ops/b.rs", "ops/c.rs"],
        "ops/b.rs": [],
        "ops/c.rs": ["ops/a.rs"],
    }
    assert [[p.relative_to(src).as_posix() for p in c] for c in cycles(edges)] == [["ops/a.rs", "ops/c.rs"]]


def test_no_rust_file_imports_another_that_imports_it_back():
    found = []
    for name, src in crates():
        edges = graph(src)
        for comp in cycles(edges):
            sub = {f: edges[f] & set(comp) for f in comp}
            loop = find_cycle(sub)
            found.append(
                f"{name}: {len(comp)} files in a loop: "
                + ", ".join(str(f.relative_to(src)) for f in comp)
                + "\n    e.g. "
                + " -> ".join(str(f.relative_to(src)) for f in loop)
            )
    assert not found, "import cycles:\n" + "\n".join(found)
