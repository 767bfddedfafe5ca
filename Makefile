VENV ?= .venv
PY := $(VENV)/bin/python
# requirements/clients.txt is the clients' venv's, not this one's
SETUP_INPUTS := scripts/setup.sh pyproject.toml setup.py raincheck_client/pyproject.toml \
	$(filter-out requirements/clients.txt,$(wildcard requirements/*.txt))

.PHONY: setup demo test test-kernels test-clients lint bench protos wheels clean

setup: $(VENV)/.installed

$(VENV)/.installed: $(SETUP_INPUTS)
	bash scripts/setup.sh $(VENV)

demo: setup          ## the main job on the embedded default
	$(PY) -m services.cli demo

# pytest-xdist worker processes, each a test file at a time (a file's module fixtures built once); 0: serial
TEST_WORKERS ?= 2
test: export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
test: export RAY_USAGE_STATS_ENABLED=0
test: setup          ## the whole suite (what CI runs)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

KERNELS ?= .kernels
test-kernels: setup  ## fla's Triton kernels on the CPU (TRITON_INTERPRET=1): the accel extra goes into $(KERNELS)
	$(PY) -m pip install -q --no-deps -c requirements/constraints.txt --target $(KERNELS) -r requirements/accel.txt
	TRITON_INTERPRET=1 PYTHONPATH=$(abspath $(KERNELS)) $(PY) -m pytest -q tests/kernels

CLIENTS ?= .venv-clients
PYTHON ?= python3
CLIENTS_PIP := $(CLIENTS)/bin/python -m pip --disable-pip-version-check -q
$(CLIENTS)/.installed: requirements/clients.txt requirements/constraints.txt
	$(PYTHON) -m venv $(CLIENTS)
	$(CLIENTS_PIP) install --upgrade pip
	$(CLIENTS_PIP) install -c requirements/constraints.txt "torch==2.13.0"
	$(CLIENTS_PIP) install --no-deps -c requirements/constraints.txt -r requirements/clients.txt
	touch $@

test-clients: setup $(CLIENTS)/.installed   ## the field's clients (openai, litellm, langchain, instructor, SGLang, lm-eval) against a started server
	$(CLIENTS)/bin/python tests/clients/conformance.py --server-python $(PY) --markdown

lint: setup
	$(PY) -m ruff check .

bench: setup
	$(PY) -m bench.engine

protos: setup        ## regenerate the committed gRPC stubs after a change in proto/
	$(PY) scripts/gen_protos.py

wheels: setup        ## dist/: raincheck-client (the SDK: grpcio + protobuf) and raincheck-serve
	$(PY) -m pip wheel --no-deps --no-build-isolation -w dist ./raincheck_client .

clean:
	rm -rf $(VENV) $(KERNELS) $(CLIENTS) .pytest_cache .ruff_cache build dist raincheck_client/build
