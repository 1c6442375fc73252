# Every target bootstraps .venv on first use.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
TORCH_VERSION ?= 2.13.0
# The CPU wheel, where pip's configuration keeps local wheels (PIP_FIND_LINKS; on these machines
# /opt/wheels). Without one, pip resolves torch==$(TORCH_VERSION) through its own configuration.
TORCH_WHEEL := $(firstword $(wildcard $(PIP_FIND_LINKS)/torch-$(TORCH_VERSION)+cpu-cp311-*.whl))

.PHONY: demo test lint typecheck unit bench chaos clean browser ui-screenshots

# uv installs what pip did in less than half the time (measured on a fresh clone), compiling the
# bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set (as on these machines) nothing else ever
# writes it, and every process then compiles torch, prefect and mlflow afresh (the suite took twice
# the CPU: import torch alone 9.7 s instead of 3.9). torch first, pinned
# exactly: the local CPU wheel, else pip's pick of torch==$(TORCH_VERSION); a bare "torch" could
# resolve to a multi-GB CUDA build. The editable install then finds torch satisfied and leaves it.
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip uv
	$(if $(TORCH_WHEEL),$(UV) pip install -q --compile-bytecode --python $(PY) "$(TORCH_WHEEL)",$(PY) -m pip install -q "torch==$(TORCH_VERSION)")
	$(UV) pip install -q --compile-bytecode --python $(PY) -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m spotrun.demo

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy does not follow setuptools' editable finder (the rooms trainer/, tasks/, ... are installed as
# spotrun.trainer, spotrun.tasks, ...): it checks them through a tree of links laid out as the wheel is
# (.mypy-tree/spotrun), made anew each time. The canary holds one deliberate type error that mypy must
# report: an import it could not resolve would be typed Any and check nothing.
MYPY_TREE := .mypy-tree/spotrun
typecheck: $(VENV)/.installed
	rm -rf .mypy-tree && mkdir -p $(MYPY_TREE)
	for f in spotrun/*; do ln -s ../../$$f $(MYPY_TREE)/; done
	for room in trainer tasks flows deployments; do ln -s ../../$$room $(MYPY_TREE)/$$room; done
	$(VENV)/bin/mypy
	! $(VENV)/bin/mypy tests/typing_canary.py > .mypy-tree/canary.txt
	grep -q 'typing_canary.py:[0-9]*: error: Incompatible types in assignment' .mypy-tree/canary.txt

# Three workers, one test file each at a time (files share servers through module fixtures): some
# end-to-end tests mostly wait (on Prefect servers, heartbeats, the zombie window), and a third
# worker fills those waits. On 2 cores the suite is CPU-bound (84% busy, sampled): pytest took 11.0
# min on 2026-12-03 once torchrun and its ranks forked from the worker (13.3-13.8 min before), and 11.8
# min on 2026-12-06 with the Transformers and Lightning flows and the deadline replay (2,119 tests).
test: $(VENV)/.installed browser lint typecheck
	$(VENV)/bin/pytest -q -n 3 --dist loadfile --no-loadscope-reorder

# Headless Chromium for the UI check (tests/e2e/test_alerts.py): Debian's package, installed as root
# (~20 s, once). Without it the UI test is skipped with the reason.
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		echo "chromium is not installed: the UI check will be skipped (apt-get install chromium)"

# Refresh the README's screenshots from a real server, flow run and browser.
ui-screenshots: $(VENV)/.installed browser
	SPOTRUN_SCREENSHOTS=docs/img $(VENV)/bin/pytest -q tests/e2e/test_alerts.py -k ui

bench: $(VENV)/.installed
	$(PY) bench/checkpoint.py
	$(PY) bench/recovery.py
	$(PY) bench/notice.py

# The fault campaign: 1,000 faults, ~20 min on 2 cores; last line JSON (docs/operations.md).
chaos: $(VENV)/.installed
	$(PY) bench/chaos.py --faults 1000 --seed 0

clean:
	rm -rf $(VENV) .spotrun .pytest_cache .mypy_cache .ruff_cache .mypy-tree build
