"""Deployment tools around the Flower app (:mod:`fedproto.flower`): a local federation, TLS
credentials, the SuperNode supervisor, the warm executor and its children, a site's data files
and the address check. Nothing in the Flower app imports them. docs/architecture.md, "Layout".
"""
