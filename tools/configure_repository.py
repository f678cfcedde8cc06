"""Point the book at a repository, a branch and a published site; then rewrite the set-up cells.

    python tools/configure_repository.py https://github.com/OWNER/REPO BRANCH [PAGES_URL]

The pages workflow runs this with values from its own context (github.server_url,
github.repository, github.ref_name, and the Pages URL of actions/configure-pages), so publishing
needs no edit of _config.yml. Edits the three lines in place, keeping the file's comments.
"""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def configure(text: str, url: str, branch: str, pages_url: str = "") -> str:
    def set_key(text, section, key, value):
        block = re.search(rf"^{section}:\n((?:[ \t]+.*\n|\n)*)", text, re.M)
        if block is None:
            return text.rstrip("\n") + f"\n\n{section}:\n  {key}: {value}\n"
        body = block.group(1)
        line = re.compile(rf"^(\s+){key}:.*$", re.M)
        body = (
            line.sub(lambda m: f"{m.group(1)}{key}: {value}", body, count=1)
            if line.search(body)
            else f"  {key}: {value}\n" + body
        )
        return text[: block.start(1)] + body + text[block.end(1) :]

    text = set_key(text, "repository", "url", url.rstrip("/"))
    text = set_key(text, "repository", "branch", branch)
    if pages_url:
        text = set_key(text, "html", "baseurl", pages_url.rstrip("/") + "/")
    return text


def main(argv):
    if len(argv) not in (2, 3) or not argv[0].startswith("https://"):
        print(__doc__)
        return 2
    cfg = ROOT / "_config.yml"
    cfg.write_text(configure(cfg.read_text(), *argv))
    return subprocess.call(
        [sys.executable, str(ROOT / "tools" / "sync_setup_cells.py")]
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
