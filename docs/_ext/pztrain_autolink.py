"""Guides, notebooks, the installation page and the changelog link the pztrain
names they use.

An inline literal of a guide or a notebook (Markdown's single backticks) whose text
is a public pztrain name becomes a link to that name's entry in the API reference:
```` `pztrain.fit` ````, `` `fit` ``, `` `fit()` ``, `` `ArrayLoader` ``,
`` `pztrain.data.GrainLoader` ``, `` `TrainState.apply_gradients` ``, the module
`` `pztrain.data` ``. Names are matched against the public modules' ``__all__``
(`pztrain_api.public_target`) and resolved against the entries the reference
holds; any other literal (``state``, ``loss_fn(...)``, a bare module name such as
``data``, a name two modules export, an attribute without an entry) stays a literal.
Code blocks are left alone, and so are literals in headings.
"""

from __future__ import annotations

import re

from docutils import nodes
from pztrain_api import public_target
from sphinx import addnodes
from sphinx.transforms import SphinxTransform

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
PAGES = ("guides/", "notebooks/", "index", "installation", "changelog")


def link_target(text: str) -> str | None:
    """The reference target of a literal's text, or ``None`` to leave it."""
    name = text.strip().removesuffix("()")
    if not NAME.fullmatch(name):
        return None
    found = public_target(name)
    if found is None:
        return None
    home, rest = found
    return home + rest


class LinkPublicNames(SphinxTransform):
    """Wraps each inline literal naming a public pztrain object in a reference."""

    default_priority = 500

    def apply(self, **kwargs) -> None:
        if not self.env.docname.startswith(PAGES):
            return
        for literal in list(self.document.findall(nodes.literal)):
            parent = literal.parent
            if isinstance(parent, (addnodes.pending_xref, nodes.reference)):
                continue
            if any(isinstance(a, nodes.title) for a in _ancestors(literal)):
                continue
            target = link_target(literal.astext())
            if target is None:
                continue
            ref = addnodes.pending_xref(
                "",
                refdomain="py",
                reftype="obj",
                reftarget=target,
                refexplicit=True,
                refwarn=False,
                refdoc=self.env.docname,
                pztrain_autolink=True,
            )
            literal.replace_self(ref)
            ref += literal
            literal["classes"] = [*literal.get("classes", []), "xref", "py", "py-obj"]


def _ancestors(node: nodes.Node):
    while node.parent is not None:
        node = node.parent
        yield node


def setup(app):
    app.setup_extension("pztrain_api")
    app.add_transform(LinkPublicNames)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
