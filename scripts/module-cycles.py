#!/usr/bin/env python3
"""Fails when two source files of one crate `use` each other (a module cycle): a type lives
where both sides can import it. Reads `crate::`/`super::` paths (and, in a crate root, plain
paths to its own modules); test modules are left out. Run by `scripts/test.sh lint`."""

import os
import re
import sys

CRATES = [".", "balance", "config", "wire", "worker", "client", "control", "operator", "testkit", "python"]


def module_file(base: str, path: str):
    parts = path.split("::")
    for n in range(len(parts), 0, -1):
        for candidate in (os.path.join(base, *parts[:n]) + ".rs", os.path.join(base, *parts[:n], "mod.rs")):
            if os.path.exists(candidate):
                return candidate
    return None


def defining_file(src: str, name: str):
    for root in ("lib.rs", "main.rs"):
        path = os.path.join(src, root)
        if not os.path.exists(path):
            continue
        text = open(path).read()
        if re.search(rf"^\s*pub (?:struct|enum|type|trait|fn|const|static) {name}\b", text, re.M):
            return path
        for m in re.finditer(r"^\s*pub use ([a-z_][a-z0-9_]*)::([^;]*);", text, re.M):
            if re.search(rf"\b{name}\b", m.group(2)):
                return module_file(src, m.group(1))
    return None


def dependencies(src: str, path: str) -> set:
    text = re.split(r"#\[cfg\(test\)\]\s*mod tests", open(path).read())[0]
    root = os.path.basename(path) in ("lib.rs", "main.rs")
    found = set()
    for m in re.finditer(r"\b(crate|super)::([a-z_][a-z0-9_]*(?:::[a-z_][a-z0-9_]*)*)", text):
        found.add(module_file(src if m.group(1) == "crate" else os.path.dirname(path), m.group(2)))
    # An item named from the crate root (`crate::Type`): the root file when defined there,
    # else the module the root re-exports it from.
    for m in re.finditer(r"\bcrate::([A-Z][A-Za-z0-9_]*)", text):
        found.add(defining_file(src, m.group(1)))
    for m in re.finditer(r"\buse crate::\{([^}]*)\}", text):
        for item in m.group(1).split(","):
            found.add(module_file(src, item.strip().split("::")[0]))
    if root:
        for m in re.finditer(r"^\s*(?:pub )?use ([a-z_][a-z0-9_]*)::", text, re.M):
            found.add(module_file(src, m.group(1)))
    return {f for f in found if f and f != path}


def main() -> int:
    cycles = []
    for crate in CRATES:
        src = os.path.join(crate, "src")
        files = [os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs if f.endswith(".rs")]
        deps = {f: dependencies(src, f) for f in files}
        cycles += [(a, b) for a in deps for b in deps[a] if a < b and a in deps.get(b, ())]
    for a, b in cycles:
        print(f"module cycle: {a} and {b} use each other", file=sys.stderr)
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
