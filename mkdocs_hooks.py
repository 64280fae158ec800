"""MkDocs hooks.

* The options page's table is generated from RunConfig at build time
  (:func:`fedproto.config.run_options.fill_options_page`), so the site never shows a stale option list.
* The docstrings use Sphinx cross-reference roles (``:class:`RunConfig```); in the API reference
  the role prefix is dropped so that only the name, in code style, remains.
"""

from fedproto.config.run_options import fill_options_page

ROLES = ("class", "func", "meth", "attr", "data", "mod", "exc", "obj")


def on_page_markdown(markdown, page, config, files):
    """Fill the options table of ``options.md``; leave other pages as they are."""
    if page.file.src_uri == "options.md":
        return fill_options_page(markdown)
    return markdown


def on_page_content(html, page, config, files):
    """API reference: ``:class:<code>~a.B</code>`` -> ``<code>a.B</code>``."""
    if page.file.src_uri != "api.md":
        return html
    for role in ROLES:
        html = html.replace(f":{role}:<code>", "<code>")
    return html.replace("<code>~", "<code>")
