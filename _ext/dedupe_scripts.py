"""Drop repeated <script> entries from each page.

sphinx-thebe registers its inline configuration script once per read of the environment; with
Jupyter Book 1.x it ends up twice in every page, and the second copy throws "Identifier
'THEBE_JS_URL' has already been declared" in the browser. Keep the first copy of each script.
"""


def _dedupe(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, kept = set(), []
    for js in scripts:
        # an inline script's filename is None or '' depending on how it was registered
        key = (
            getattr(js, "filename", js) or "",
            repr(sorted(getattr(js, "attributes", {}).items())),
        )
        if key not in seen:
            seen.add(key)
            kept.append(js)
    scripts[:] = kept


def setup(app):
    app.connect("html-page-context", _dedupe, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
