"""A Sphinx extension for the course's website (book/_config.yml names it in sphinx.local_extensions).

sphinx-thebe, which Jupyter Book always loads, adds its inline configuration script twice, so every page raised
"Identifier 'THEBE_JS_URL' has already been declared" in the browser (tests/test_book.py checks for page errors):
each page keeps one copy of every script.
"""

from __future__ import annotations


def _one_of_each_script(app, pagename, templatename, context, doctree) -> None:
    seen, kept = set(), []
    for js in context.get("script_files", []):
        # the same inline script comes once with filename None and once with ""
        key = (getattr(js, "filename", str(js)) or "", tuple(sorted(getattr(js, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            kept.append(js)
    context["script_files"] = kept


def setup(app):
    app.connect("html-page-context", _one_of_each_script)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
