# The two commands of the README:
#   make book   set up .venv, build the HTML book with every chapter executed
#   make test   set up .venv (and Chromium, where it can), run the whole test suite
#   make test-quick   the edit loop (minutes): tests/kernels/ at small sizes and tests/book/'s
#                     checks of the sources (prose, widths); no chapter executed, no browser,
#                     no inspector (tests/scheduling.py)
#   make inspect-record   after editing a kernel: record what the compiler says of its variants
# Neither needs a GPU: without one, kernels run in Triton's interpreter on the CPU.
#   make gpu-check   on a CUDA GPU only, with the machine's own Python (nothing installed):
#                    benchmark, kernel tests, inspector and chapters, each under a budget
#                    (tools/gpu_check.py; `python3 tools/gpu_check.py --dry-run` rehearses it)
#   make gpu-wheels  beforehand, where pip reaches the index: the wheels the GPU machine lacks

PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: book test test-quick inspect-record gpu-check gpu-wheels setup browser clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	@# The bytecode, on every core: pip compiles one file at a time (74 s of a 78 s set-up
	@# measured here on 2 cores; 33 s + 18 s this way). Not the packages' own test folders,
	@# which nothing imports (one of torch's is Python 3.12 syntax, which 3.11 cannot
	@# compile). A file that does not compile is left as pip leaves it: imported from source.
	$(PY) -m compileall -q -j 0 -x '/site-packages/(.*/)?(tests?|testing/_internal)/' \
	  $(VENV)/lib || true
	touch $@

# The chapters are executed first, one kernel per core, into the build's execution cache (a
# failing chapter stops here); the build then renders them (_config.yml: execute_notebooks: cache).
# Unchanged chapters on unchanged kernels/ are not executed again (tools/execute_chapters.py).
book: $(STAMP) browser
	$(PY) tools/sync_setup_cells.py --check
	$(PY) tools/execute_chapters.py
	$(VENV)/bin/jupyter-book build . -W -n --keep-going --builder html
	@# the whole book as one PDF, printed by Chromium (tools/book_pdf.py); the intro links it
	$(PY) tools/book_pdf.py _build/html
	@echo "Book built: file://$(CURDIR)/_build/html/index.html"

# Debian's Chromium for the browser tests (Playwright's own browser download is not used).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "Installing Chromium (Debian package) for the browser tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "Chromium not found and cannot be installed here: browser tests will be skipped"; fi; }

# One worker per core (pytest-xdist). The chapters, their HTML and the inspector's compile run
# once, in background processes, while the kernel tests run; the browser tests of a page share
# a worker (--dist loadgroup): the plugin tests/scheduling.py. REQUIRE_BOOK: a missing book package fails
# the run instead of skipping its tests.
PYTEST_WORKERS ?= -n auto --dist loadgroup

test: $(STAMP) browser
	REQUIRE_BOOK=1 $(PY) -m pytest $(PYTEST_WORKERS)

test-quick: $(STAMP)
	$(PY) -m pytest $(PYTEST_WORKERS) --quick

# After editing a kernel (or changing Triton): what the compiler reports for every variant the
# tests check, written to data/inspect/variants.jsonl for a new machine to read instead of
# compiling (kernels/normbook/lab/inspector/). Compiles only what is neither cached nor recorded;
# FROM_SCRATCH=1 reads nothing and compiles every variant (half an hour on two cores).
inspect-record: $(STAMP)
	$(PY) -m normbook.lab.inspector --record $(if $(FROM_SCRATCH),--from-scratch)

# Refuses (exit 2) on a machine without a CUDA GPU; at most 8 minutes on one (the budgets of
# tools/gpu_check.py). No venv, no pip, no apt-get: it must run offline on the GPU machine.
gpu-check:
	$(PYTHON) tools/gpu_check.py

# Into .whl/ (ignored): nbformat, nbclient, ipykernel, plotly and what they need, for CPython
# 3.12 on manylinux x86_64, less what the GPU machine already has; gpu-check installs them.
gpu-wheels:
	$(PYTHON) tools/gpu_check.py --download-wheels

clean:
	rm -rf _build
