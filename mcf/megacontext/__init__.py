"""MegaContext tree storage: LOD0/LOD1/LOD2 ``.ctx`` files, streaming ingest, snapshots and
working-context assembly (see docs/megacontext.md).

>>> import mcf.megacontext as mc
>>> tree = mc.create("tree/", embedding_dim=384, model_name="all-MiniLM-L6-v2")   # doctest: +SKIP
>>> tree.append_tokens(ids)                                                       # doctest: +SKIP
>>> mc.build_gists(tree, mc.MeanPool(embedding_table))                            # doctest: +SKIP
>>> wc = tree.assemble(mc.plan_tail(tree, budget=512, recent_tokens=128), embedding_table)  # doctest: +SKIP
>>> plan = mc.focus_plan(tree, plan, lensnet(wc), budget=512, tau_expand=0.2, tau_collapse=0.2)  # doctest: +SKIP
"""

from mcf.megacontext._layout import (CTX_DTYPES, DEFAULT_BLOCK_SIZE, HEADER_SIZE, LEVEL_FILES, MAGIC, CtxHeader,
                                     children_of, gist_offset, parent_of, parse_header, raw_gist_dtype, span_of,
                                     token_offset)
from mcf.megacontext.assembly import Plan, WorkingContext, assemble, plan_coverage, plan_tail
from mcf.megacontext.focus import focus_plan
from mcf.megacontext.gist import MeanPool, build_gists
from mcf.megacontext.snapshots import snapshot
from mcf.megacontext.tree import Problem, Tree, create, open_tree, restore, verify

open = open_tree  # noqa: A001 - mcf.megacontext.open(path, mode) mirrors mcf.open

__all__ = [
    "create", "open", "open_tree", "Tree", "Problem", "verify", "snapshot", "restore",
    "Plan", "WorkingContext", "assemble", "plan_tail", "plan_coverage", "focus_plan", "MeanPool", "build_gists",
    "CtxHeader", "parse_header", "token_offset", "gist_offset", "raw_gist_dtype", "span_of", "children_of", "parent_of",
    "MAGIC", "HEADER_SIZE", "LEVEL_FILES", "DEFAULT_BLOCK_SIZE", "CTX_DTYPES",
]
