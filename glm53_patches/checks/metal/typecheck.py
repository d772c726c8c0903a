"""Type-check Metal kernel sources as MSL, with clang (libclang) and the shim ``msl.h``.

``errors(source)`` takes the text MLX generates (``source.generated``) and
returns clang's errors for it: the shim in front (address spaces as clang
``address_space`` attributes, MSL's bfloat conversions, the SIMD-group and
math functions declared), the text preprocessed (g++ -E) so that
``threadgroup`` declarations can become ``static`` (``expand``), MLX's
explicit instantiation line kept without the Metal attributes clang rejects
there, and multi-argument vector constructors written as lists. ``python -m glm53_patches.checks.metal.typecheck`` checks every
case in ``cases.py`` and prints a table.

What this cannot see: anything past the front end (the Metal compiler's
code generation, fma contraction, pipeline thread limits), Metal attribute
checks (``[[buffer]]``, thread-attribute types), and the parts of MLX's
prepended utils.h the shim does not declare (a kernel using them fails here
rather than passing).
"""

import pathlib
import re
import subprocess
import sys

SHIM = pathlib.Path(__file__).with_name("msl.h")
_ADDRESS_SPACE_3 = "__attribute__((address_space(3)))"
_INSTANTIATION = re.compile(r'^template \[\[host_name\("[^"]*"\)\]\] \[\[kernel\]\] ', re.M)
# A statement that starts with `threadgroup` (after the preprocessor: no comments, no directives).
_DECLARATION = re.compile(r"(\A|[;{}])(\s*)__msl_threadgroup__\b")
_ATTRIBUTE = re.compile(r"\[\[__msl_threadgroup__\(\d+\)\]\]")  # [[threadgroup(n)]]: a binding, nothing to check here
_VECTOR_CALL = re.compile(r"\b(?:float|half|bfloat|int|uint|short|ushort|char|uchar|long|ulong|bool)[234]\(")
# MSL forbids implicit float (or half) -> bfloat; clang only warns about it for __bf16.
_TO_BFLOAT = re.compile(r"implicit conversion loses floating-point precision: '[^']*' to '[^']*'( \(aka '[^']*'\))?$")


def _vector_constructors(text):
    """``float4(a, b, c, d)`` -> ``float4{a, b, c, d}``: clang's ext vectors take a list, not several arguments."""
    out, at = [], 0
    for match in _VECTOR_CALL.finditer(text):
        if match.start() < at:
            continue
        open_at = match.end() - 1
        depth, commas, i = 0, 0, open_at
        while True:
            c = text[i]
            depth += c in "([{"
            depth -= c in ")]}"
            commas += c == "," and depth == 1
            if depth == 0:
                break
            i += 1
        if commas:
            out += [text[at:open_at], "{", _vector_constructors(text[open_at + 1:i]), "}"]
            at = i + 1
    return "".join(out) + text[at:]


def expand(source, typecheck, defines=()):
    """``source`` after the shim and the preprocessor, with ``threadgroup`` resolved.

    A declaration that starts with ``threadgroup`` becomes ``static`` (one
    array per threadgroup, which the emulation's host threads share); every
    other ``threadgroup`` is the address space (typecheck) or nothing.
    """
    space = _ADDRESS_SPACE_3 if typecheck else ""
    text = f'#include "{SHIM.name}"\n' + _INSTANTIATION.sub("template ", source)
    flags = ["-DMSL_TYPECHECK"] if typecheck else []
    flags += [f"-D{d}" for d in defines]
    done = subprocess.run(["g++", "-E", "-P", "-x", "c++", "-std=c++20", *flags, f"-I{SHIM.parent}", "-"],
                          input=text, capture_output=True, text=True, check=True)
    text = _DECLARATION.sub(lambda m: f"{m.group(1)}{m.group(2)}static {space}", _ATTRIBUTE.sub("", done.stdout))
    return text.replace("__msl_threadgroup__", space)


def errors(source):
    """clang's errors for ``source`` as MSL (empty when it type-checks)."""
    import clang.cindex as ci

    text = _vector_constructors(expand(source, typecheck=True))
    index = ci.Index.create()
    unit = index.parse("kernel.metal.cpp", args=["-x", "c++", "-std=c++17", "-fsyntax-only", "-nostdinc",
                                                 "-nostdinc++", "-Wno-unknown-attributes",
                                                 "-Wimplicit-float-conversion"],
                       unsaved_files=[("kernel.metal.cpp", text)])
    lines = text.splitlines()
    found = []
    for d in unit.diagnostics:
        if d.severity >= ci.Diagnostic.Error or (_TO_BFLOAT.search(d.spelling) and "__bf16'" in d.spelling):
            line = lines[d.location.line - 1].strip() if 0 < d.location.line <= len(lines) else ""
            found.append(f"{d.spelling} [{line[:120]}]")
    return found


def main():
    from . import cases, source

    failed = 0
    with source.verbose_kernels():
        for kernel, name, fn, args in cases.cases(sys.argv[1:] or None):
            texts = source.generated(fn, *args)
            problems = ["no kernel launched"] if not texts else [e for t in texts for e in errors(t)]
            failed += bool(problems)
            print(f"{kernel:28} {name:60} {'FAIL' if problems else 'ok'}", flush=True)
            for p in problems[:5]:
                print("    ", p)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
