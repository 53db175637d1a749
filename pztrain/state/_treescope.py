"""Treescope's text view of a `TrainState`, unfolded by width.

Treescope lays a tree out for about 20 lines and folds the rest; in text a
folded node is written on one line, which for a model or an optimizer state is
thousands of characters long. `readable_treescope` is the hint
``TrainState.__treescope_repr__`` gives treescope: in text every node wider
than a line is unfolded; the HTML view keeps treescope's foldable layout.
"""

from __future__ import annotations

import inspect
import io
from collections.abc import Sequence
from typing import Any

import optax
from treescope import layout_algorithms, rendering_parts, repr_lib

__all__ = ["readable_treescope", "short_functions"]


def _foldables(part: Any) -> list[Any]:
    """Every foldable node in ``part``, outermost first."""
    found, todo = [], list(part.foldables_in_this_part())
    while todo:
        node = todo.pop()
        found.append(node)
        todo += node.as_expanded_part().foldables_in_this_part()
    return found


class _UnfoldedInText(rendering_parts.RenderableTreePart):
    """A rendering that HTML shows as laid out, and text unfolded by width.

    Treescope folds nodes to fit ~20 lines; in text a folded node is one line,
    thousands of characters long for a model. For text, this part unfolds every
    node wider than `WIDTH`, renders, and puts the layout back.
    """

    WIDTH = 80

    def __init__(self, part: Any):
        self.part = part

    def _compute_collapsed_width(self) -> int:
        return self.part.collapsed_width

    def _compute_newlines_in_expanded_parent(self) -> int:
        return self.part.newlines_in_expanded_parent

    def _compute_layout_marks_in_this_part(self) -> frozenset[Any]:
        return self.part.layout_marks_in_this_part

    def foldables_in_this_part(self) -> Sequence[Any]:
        return self.part.foldables_in_this_part()

    def html_setup_parts(self, context: Any, /) -> set[Any]:
        return self.part.html_setup_parts(context)

    def render_to_html(self, stream: io.TextIOBase, **kwargs: Any) -> None:
        self.part.render_to_html(stream, **kwargs)

    def render_to_text(self, stream: io.TextIOBase, **kwargs: Any) -> None:
        nodes = _foldables(self.part)
        layout = [node.get_expand_state() for node in nodes]
        for node in nodes:
            node.set_expand_state(rendering_parts.ExpandState.WEAKLY_COLLAPSED)
        try:
            layout_algorithms.expand_for_balanced_layout(
                self.part, max_height=None, target_width=self.WIDTH
            )
            self.part.render_to_text(stream, **kwargs)
        finally:
            for node, state in zip(nodes, layout, strict=True):
                node.set_expand_state(state)


def readable_treescope(rendering: Any, members: int | None = None) -> Any:
    """Makes treescope's text render of ``rendering`` unfold by width; a
    population's (``members``) gets a comment line saying so first.

    ``TrainState.__treescope_repr__`` passes penzai's rendering of the state
    through this, so ``treescope.render_to_text(state)`` shows every part of the
    state, however deep, in lines of about 80 characters (a single array's
    summary may be longer); notebooks keep treescope's foldable HTML.

    Args:
      rendering: What a ``__treescope_repr__`` returns (or ``NotImplemented``).
      members: A population's member count (`pztrain.population`), or ``None``.

    Returns:
      The same rendering, wrapped.
    """
    if isinstance(rendering, rendering_parts.RenderableAndLineAnnotations):
        part = _UnfoldedInText(rendering.renderable)
        if members is not None:  # every array's axis 0 is the member axis
            note = f"# a population of {members} members: axis 0 of every array\n"
            note = rendering_parts.comment_color(rendering_parts.text(note))
            part = rendering_parts.siblings(note, part)
        return rendering_parts.RenderableAndLineAnnotations(part, rendering.annotations)
    if isinstance(rendering, rendering_parts.RenderableTreePart):
        return _UnfoldedInText(rendering)
    return rendering


class _Function:
    """A function shown by its qualified name: no address, and no comment with
    its source file (treescope's ``# Defined at line 78 of /…/optax/…``, which
    made an optimizer's lines 150-200 characters long)."""

    def __init__(self, fn: Any):
        self.fn = fn

    def __repr__(self) -> str:
        return f"<function {self.fn.__qualname__}>"

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        del path, subtree_renderer
        return rendering_parts.text(repr(self))


def short_functions(subtree_renderer: Any) -> Any:
    """``subtree_renderer`` for a state's fields, with an optax transformation
    (``optimizer_def``) shown as its type and its functions' qualified names:
    ``GradientTransformationExtraArgs(init=<function chain.<locals>.init_fn>,
    ...)``."""

    def render(node: Any, path: str | None = None) -> Any:
        if not isinstance(node, optax.GradientTransformation):
            return subtree_renderer(node, path=path)
        fields = {
            name: _Function(value) if inspect.isfunction(value) else value
            for name, value in node._asdict().items()
        }
        return repr_lib.render_object_constructor(
            type(node), fields, path, subtree_renderer
        )

    return render
