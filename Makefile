# Two commands for a newcomer: `make demo` and `make test`. Each creates .venv when it is missing
# and installs what it needs: the demo torch, attnkit and its command's extras (.[cli]); the tests
# the development extras (.[dev]: tests, linters, docs tools, transformers) on top. A stamp file
# per set says it is installed, until pyproject.toml or constraints.txt change.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEMO_STAMP := $(VENV)/.installed-cli
DEV_STAMP  := $(VENV)/.installed-dev
# An index to take torch from first, e.g. https://download.pytorch.org/whl/cpu for the CPU build
# (pip's default torch on Linux is the multi-GB CUDA build). Empty: torch comes with the rest.
TORCH_INDEX ?=

.PHONY: demo test lint typecheck pytest docs native bench clean

# $(call install,EXTRAS): .venv if missing, then torch pinned by constraints.txt (from TORCH_INDEX
# when set) and attnkit from this checkout, editable, with EXTRAS.
define install
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(if $(TORCH_INDEX),$(BIN)/python -m pip install --quiet -c constraints.txt torch --index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[$(1)]'
	touch $@
endef

$(DEMO_STAMP): pyproject.toml constraints.txt
	@echo "Installing into $(VENV): torch, attnkit and what the demo needs (a few minutes, once)"
	$(call install,cli)

$(DEV_STAMP): pyproject.toml constraints.txt
	@echo "Installing into $(VENV): torch, attnkit and its development tools (a few minutes, once)"
	$(call install,dev)

demo: $(DEMO_STAMP)
	$(BIN)/attnkit demo

# The tests run in TEST_PROCESSES processes (pytest-xdist; default: the cores, at most 4), each
# test on whichever process is free. TEST_PROCESSES=0 runs them in this one.
TEST_PROCESSES ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ "$$n" -gt 4 ] && n=4; echo $$n)
PYTEST := $(BIN)/pytest -q -n $(TEST_PROCESSES) --dist worksteal

# The checks, the docs and the native kernel's build (a minute or more, once: the kernel is kept
# in attnkit's cache folder) run side by side, each target's output printed whole as it ends;
# then the tests, which read the site just built (ATTNKIT_BUILT_SITE) instead of building it.
test: $(DEV_STAMP)
	$(MAKE) --no-print-directory -j4 --output-sync=target lint typecheck docs native
	ATTNKIT_BUILT_SITE=site $(PYTEST)

# The native kernel, compiled for this CPU and torch unless already built (see docs/deploying.md).
native: $(DEV_STAMP)
	$(BIN)/python -c "from attnkit import _native; _native.load(); ok, why = _native.status(); \
		print('native kernel:', 'ready' if ok else why)"

lint: $(DEV_STAMP)
	$(BIN)/ruff check src tests benchmarks docs
	$(BIN)/ruff format --check src tests benchmarks docs

typecheck: $(DEV_STAMP)
	$(BIN)/mypy

pytest: $(DEV_STAMP)
	$(PYTEST)

# The site, built strictly: a broken cross-reference, a docstring that does not parse or a tutorial
# step that raises fails the build. It runs the tutorial's code and draws the benchmark plots from
# the JSON in docs/benchmarks/data/. Open site/index.html: the site works from disk (pages are
# page.html files, search works offline, and the build fails on a link that leads to no file).
docs: $(DEV_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The benchmarks need torch and attnkit only: the demo's install is enough.
bench: $(DEMO_STAMP)
	$(BIN)/python benchmarks/bench_backends.py

clean:
	rm -rf $(VENV) build dist site src/*.egg-info
