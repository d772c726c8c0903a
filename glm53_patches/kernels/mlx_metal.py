"""MLX's own Metal kernel text, read from the headers the installed mlx wheel ships.

A Metal twin that must compute what an MLX kernel computes can call that
kernel's own helpers (``qdot``, ``load_vector``, ...) rather than a copy:
``declaration`` returns one of them verbatim from the installed MLX, so the
twin follows the MLX it runs with. The Metal checks read stock's kernels the
same way.
"""

import pathlib

import mlx.core as mx

HEADERS = pathlib.Path(mx.__file__).parent / "include" / "mlx" / "backend" / "metal" / "kernels"


def declaration_in(text, start):
    """From ``text``, the declaration that begins at the line ``start``, verbatim.

    It runs to the brace that closes the first one opened after ``start``
    (and a ``;`` right after it); a ``template <...>`` line just above is kept.
    """
    at = text.index(start)
    above = text.rfind("\n", 0, at - 1)
    line_above = text[above + 1:at]
    if line_above.startswith("template"):
        at = above + 1
    else:  # a multi-line template header
        head = text.rfind("template <", 0, at)
        if head != -1 and text[head:at].count(";") == 0 and text[head:at].count("{") == 0:
            at = head
    depth, i = 0, text.index("{", text.index(start))
    while True:
        depth += text[i] == "{"
        depth -= text[i] == "}"
        if depth == 0:
            break
        i += 1
    end = i + 1 + (text[i + 1:i + 2] == ";")
    return text[at:end] + "\n"


def line(path, start):
    """The line of the installed MLX Metal header ``path`` that begins with ``start`` (a constant or a
    macro its helpers use), verbatim; OSError where this mlx ships no such header."""
    text = (HEADERS / path).read_text()
    at = text.index("\n" + start) + 1
    return text[at:text.index("\n", at) + 1]


def declaration(path, start):
    """The declaration of the installed MLX Metal header ``path`` that begins at ``start``; OSError where
    this mlx ships no such header."""
    return declaration_in((HEADERS / path).read_text(), start)
