# The two commands of the README:
#   make run    install the service into .venv and start it on :8000 (GPU backend if CuPy sees a device) as the
#               container does: matmul-service with its defaults (HTTP workers and shared memory from the host's
#               CPUs and memory, batching on); MATMUL_* variables or a .env file change them (docs/deployment.md, "Settings")
#   make test   install the test tools into .venv and run ruff, mypy, the import contracts and pytest
#   make mutation   mutation testing of the core modules with mutmut (hours on two cores: docs/testing.md)
#   make container-test   build the Dockerfile's images with podman (or docker) and run them as compose and the Helm
#                   chart do, on the CPU backend (tests/container; CONTAINER_BASE=stand-in where no registry is reachable)
PYTHON ?= python3
VENV ?= .venv
HOST ?= 0.0.0.0
PORT ?= 8000
BIN := $(VENV)/bin
# On a machine with an NVIDIA driver the service also gets CuPy, so `make run` serves from the GPU.
RUN_EXTRAS := $(if $(shell command -v nvidia-smi 2>/dev/null),[gpu],)

.PHONY: run test mutation container-test install-run install-test install-mutation clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The service depends on matmul-client, a distribution of its own in client/: installed together, pip takes it from there.
install-run: $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ./client -e ".$(RUN_EXTRAS)"

install-test: $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ./client -e ".[test]"

install-mutation: $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ./client -e ".[test,mutation]"

run: install-run
	$(BIN)/matmul-service --host $(HOST) --port $(PORT)

test: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m pytest $(PYTEST_ARGS)

container-test: install-test
	MATMUL_CONTAINER_TEST=1 $(BIN)/python -m pytest tests/container -p no:cacheprovider --durations=0 -rA $(PYTEST_ARGS)

# MUTANTS narrows the run to mutants whose names match (globs), e.g. MUTANTS='app.codecs.*'
mutation: install-mutation
	$(BIN)/mutmut run --max-children $(shell nproc) $(MUTANTS)
	$(BIN)/mutmut results

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache mutants
