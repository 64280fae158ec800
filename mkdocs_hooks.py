"""MkDocs hooks: the options page's table is generated from RunConfig at build time
(:func:`fedproto.options.fill_options_page`), so the site can never show a stale option list."""

from fedproto.options import fill_options_page


def on_page_markdown(markdown, page, config, files):
    """Fill the options table of ``options.md``; leave other pages as they are."""
    if page.file.src_uri == "options.md":
        return fill_options_page(markdown)
    return markdown
