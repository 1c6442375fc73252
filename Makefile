# Every target bootstraps .venv on first use.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: demo test lint typecheck unit bench chaos clean browser ui-screenshots

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned exactly: on these machines pip takes the 2.13.0 CPU wheel from local disk; a bare
	# "torch" could resolve to a multi-GB CUDA build. The editable install below then finds
	# torch already satisfied and installs nothing more for it.
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m spotrun.demo

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy

# Two workers, one test file each at a time (files share servers through module fixtures): the
# end-to-end tests mostly wait (on Prefect servers, heartbeats, the zombie window), so on 2 cores
# this took the suite from 13 to under 9 minutes (measured).
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
	rm -rf $(VENV) .spotrun .pytest_cache .mypy_cache .ruff_cache
