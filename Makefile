# Two commands for a newcomer: `make demo` and `make test`. Each creates .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# An index to take torch from first, e.g. https://download.pytorch.org/whl/cpu for the CPU build
# (pip's default torch on Linux is the multi-GB CUDA build). Empty: torch comes with the rest.
TORCH_INDEX ?=

.PHONY: demo test lint typecheck pytest docs bench clean

$(STAMP): pyproject.toml constraints.txt
	@echo "Creating $(VENV): torch, attnkit and its development tools (a few minutes, once)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(if $(TORCH_INDEX),$(BIN)/python -m pip install --quiet -c constraints.txt torch --index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/attnkit demo

test: lint typecheck pytest docs

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks docs
	$(BIN)/ruff format --check src tests benchmarks docs

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest -q

# The site, built strictly: a broken cross-reference, a docstring that does not parse or a tutorial
# step that raises fails the build. It runs the tutorial's code and draws the benchmark plots from
# the JSON in docs/benchmarks/data/. Open site/index.html: the site works from disk (pages are
# page.html files, search works offline, and the build fails on a link that leads to no file).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_backends.py

clean:
	rm -rf $(VENV) build dist site src/*.egg-info
